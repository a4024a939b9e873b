"""A causal LM that runs rows of different lengths in one forward pass over a `SlotCache`.

Live rows occupy slots 0..n-1. Each row has a cached length; a forward pass feeds q new tokens per
row at positions length..length+q-1 and the caller then says how many of them to keep (`advance`).
"""
from __future__ import annotations

import torch
from transformers import PreTrainedModel

from workers.fused_decoder import FusedDecoder
from workers.kv_cache import SlotCache


def relayout_linears_for_cpu(model: torch.nn.Module) -> None:
    """Store every decoder Linear weight as the transpose of a contiguous (in, out) matrix.

    F.linear(x, w) then runs as x @ w_t on a contiguous w_t, the layout CPU GEMV kernels stream
    fastest (decoding at small batch is a chain of GEMVs). Same values, same module tree; idempotent.
    """
    for module in model.modules():
        if isinstance(module, torch.nn.Linear) and module.weight.is_contiguous():
            module.weight = torch.nn.Parameter(module.weight.detach().t().contiguous().t(), requires_grad=False)


def _head_weight(model: PreTrainedModel) -> torch.Tensor:
    """The LM head as a (hidden, vocab) matrix, built once per model (generators are created per shard).

    On CPU it is a contiguous copy (the head is usually tied to the embedding, which needs rows), because
    GEMV against a contiguous (in, out) weight runs much faster than F.linear on the (out, in) one.
    """
    if getattr(model, "_specbatch_head", None) is None:
        weight = model.get_output_embeddings().weight.detach().t()
        model._specbatch_head = weight.contiguous() if weight.device.type == "cpu" else weight
    return model._specbatch_head


class CachedLM:
    def __init__(self, model: PreTrainedModel, max_rows: int, capacity: int):
        self.model = model
        self.decoder = model.get_decoder()
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype
        head = model.get_output_embeddings()
        self.fused = FusedDecoder.of(model) if FusedDecoder.supports(model) else None
        if self.fused is None and self.device.type == "cpu":
            relayout_linears_for_cpu(model.get_decoder())
        self.head_weight = _head_weight(model)
        self.head_bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        self.cache = SlotCache(max_rows, capacity)
        self.lengths = torch.zeros(max_rows, dtype=torch.long)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int = 0, logits: bool = True) -> torch.Tensor | None:
        """Feed `tokens` (n, q) to slots start..start+n-1; returns fp32 logits (n, q, vocab) when asked."""
        n, q = tokens.shape
        lengths = self.lengths[start : start + n]
        positions = lengths.unsqueeze(1) + torch.arange(q)
        kv_len = int(lengths.max()) + q
        visible = torch.arange(kv_len).view(1, 1, kv_len) <= positions.unsqueeze(-1)
        mask = torch.zeros(visible.shape, dtype=self.dtype).masked_fill_(~visible, torch.finfo(self.dtype).min)
        positions = positions.to(self.device)
        self.cache.rows, self.cache.write_positions, self.cache.kv_len = slice(start, start + n), positions, kv_len
        tokens, mask = tokens.to(self.device), mask.unsqueeze(1).to(self.device)
        if self.fused is not None:
            hidden = self.fused(tokens, positions, mask, self.cache)
        else:
            hidden = self.decoder(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=self.cache,
                                  use_cache=True).last_hidden_state
        return self.head(hidden) if logits else None

    def head(self, hidden: torch.Tensor) -> torch.Tensor:
        out = hidden @ self.head_weight
        return (out if self.head_bias is None else out + self.head_bias).float()

    def prefill(self, prompts: list[list[int]], start: int) -> None:
        """Cache every prompt token but the last, which the first decoding step feeds (no logits needed here)."""
        self.lengths[start : start + len(prompts)] = 0
        width = max(len(p) for p in prompts) - 1
        if width > 0:
            pad = [p[:-1] + [p[-1]] * (width - len(p) + 1) for p in prompts]
            self.forward(torch.tensor(pad), start, logits=False)
        self.lengths[start : start + len(prompts)] = torch.tensor([len(p) - 1 for p in prompts])

    def advance(self, counts: torch.Tensor, start: int = 0) -> None:
        self.lengths[start : start + len(counts)] += counts

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst, int(self.lengths[src]))
        self.lengths[dst] = self.lengths[src]
