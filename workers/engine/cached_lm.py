"""Rows of different lengths in one forward pass over a `SlotCache`.

Live rows occupy slots 0..n-1. Each row has a cached length; a forward pass feeds q new tokens per
row at positions length..length+q-1 and the caller then says how many of them to keep (`advance`).
"""
from __future__ import annotations

import torch

from workers.engine.decoding_model import DecodingModel
from workers.engine.kv_cache import SlotCache


class CachedLM:
    def __init__(self, model: DecodingModel, max_rows: int, capacity: int):
        self.model = model
        self.cache = SlotCache(max_rows, capacity)
        self.lengths = torch.zeros(max_rows, dtype=torch.long)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Feed `tokens` (n, q) to slots start..start+n-1; returns their final hidden states (n, q, hidden)."""
        n, q = tokens.shape
        lengths = self.lengths[start : start + n]
        positions = lengths.unsqueeze(1) + torch.arange(q)                      # (n, q)
        kv_len = int(lengths.max()) + q
        visible = torch.arange(kv_len).view(1, 1, kv_len) <= positions.unsqueeze(-1)  # (n, q, kv_len)
        dtype = self.model.dtype
        mask = torch.zeros(visible.shape, dtype=dtype).masked_fill_(~visible, torch.finfo(dtype).min)
        positions = positions.to(self.model.device)
        self.cache.rows, self.cache.write_positions, self.cache.kv_len = slice(start, start + n), positions, kv_len
        return self.model.decode(tokens.to(self.model.device), positions, mask.unsqueeze(1).to(self.model.device),
                                 self.cache)

    def logits(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """fp32 next-token logits (n, q, vocab) after feeding `tokens` (n, q)."""
        return self.model.logits(self.forward(tokens, start))

    def prefill(self, prompts: list[list[int]], start: int) -> torch.Tensor | None:
        """Cache every prompt token but the last, which the first decoding step feeds. Returns the hidden
        states of the cached tokens (n, longest - 1, hidden; padding past each row's length), None when
        no prompt has more than one token."""
        self.lengths[start : start + len(prompts)] = 0
        width = max(len(p) for p in prompts) - 1
        hidden = None
        if width > 0:
            pad = [p[:-1] + [p[-1]] * (width - len(p) + 1) for p in prompts]
            hidden = self.forward(torch.tensor(pad), start)
        self.lengths[start : start + len(prompts)] = torch.tensor([len(p) - 1 for p in prompts])
        return hidden

    def advance(self, counts: torch.Tensor, start: int = 0) -> None:
        self.lengths[start : start + len(counts)] += counts

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst, int(self.lengths[src]))
        self.lengths[dst] = self.lengths[src]
