"""A causal LM prepared once for decoding: the fused decoder where it applies, the LM head laid out for GEMV.

Preparation happens once, at load time, into this object: it owns the fused and re-laid-out weights,
and the transformers model it came from is left untouched (the bench runs transformers' own
`generate` on that same model). Generators, caches and drafters are then built over it per shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from transformers import PreTrainedModel

from workers.engine.fused_decoder import FusedDecoder
from workers.engine.kv_cache import SlotCache


@dataclass
class DecodingModel:
    model: PreTrainedModel             # the source model: config, generation config, embeddings, fallback decoder
    fused: FusedDecoder | None         # None: run transformers' own decoder modules
    head_weight: torch.Tensor          # (hidden, vocab)
    head_bias: torch.Tensor | None

    @classmethod
    def prepare(cls, model: PreTrainedModel) -> DecodingModel:
        """On CPU the head is a contiguous (hidden, vocab) copy: GEMV against it streams much faster than
        F.linear on the (vocab, hidden) embedding it is usually tied to."""
        head = model.get_output_embeddings()
        weight = head.weight.detach().t()
        weight = weight.contiguous() if weight.device.type == "cpu" else weight
        bias = None if getattr(head, "bias", None) is None else head.bias.detach()
        fused = FusedDecoder(model) if FusedDecoder.supports(model) else None
        return cls(model.eval(), fused, weight, bias)

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.head_weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.head_weight.dtype

    @property
    def embed(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """tokens, positions (n, q) on device; mask (n, 1, q, kv_len) additive -> final hidden (n, q, hidden)."""
        if self.fused is not None:
            return self.fused(tokens, positions, mask, cache)
        return self.model.get_decoder()(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache,
                                        use_cache=True).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (..., vocab) for hidden states (..., hidden)."""
        out = hidden @ self.head_weight
        return (out if self.head_bias is None else out + self.head_bias).float()
