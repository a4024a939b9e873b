"""A causal LM prepared once for decoding: the fused decoder where it applies, the LM head laid out for GEMV.

Preparation happens once, at load time, into this object: it owns the fused and re-laid-out weights,
and the transformers model it came from is left untouched (the bench runs transformers' own
`generate` on that same model). Generators, caches and drafters are then built over it per shard.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
from typing import TYPE_CHECKING

from workers.engine.captured_step import CapturedSteps
from workers.engine.fused_decoder import FusedDecoder
from workers.engine.kv_cache import SlotCache
from workers.engine.linear import Linear, linear

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from workers.engine.checkpoint import CheckpointLM


@dataclass
class DecodingModel:
    model: PreTrainedModel | CheckpointLM  # the source model: config, generation config, embeddings, fallback decoder
    fused: FusedDecoder | None         # None: run transformers' own decoder modules
    head: Linear                       # the LM head: hidden -> vocab
    step: str = "eager"                # eager | captured (static-shape steps, CUDA graphs on a GPU)

    @classmethod
    def prepare(cls, model: PreTrainedModel | CheckpointLM, compile: bool = False, step: str = "auto", gemv: bool = True) -> DecodingModel:
        """`compile`: torch.compile the fused decoder's layers (no effect where the fused decoder does not apply).
        `step`: `auto` captures decode steps in CUDA graphs on a GPU and runs them eagerly elsewhere; `captured`
        forces the static-shape step (eager on a CPU: the same path, testable without a GPU); `eager` never.
        `gemv=False`: packed weights only, where a CPU's width-1 kernel choice is already known (kernel_choice.py)."""
        head = model.get_output_embeddings()
        fused = FusedDecoder.of(model, compile, gemv) if FusedDecoder.supports(model) else None
        if step == "auto":
            step = "captured" if model.device.type == "cuda" else "eager"
        return cls(model.eval(), fused, Linear.of(head.weight, getattr(head, "bias", None), gemv),
                   step if fused is not None else "eager")

    def captured_steps(self, cache: SlotCache, max_rows: int) -> CapturedSteps | None:
        """Static-shape steps over `cache` when this model captures them (CUDA graphs on a CUDA device)."""
        if self.step != "captured":
            return None
        return CapturedSteps(self.fused, cache, max_rows, capture=self.device.type == "cuda")

    @property
    def config(self):
        return self.model.config

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.dtype

    @property
    def head_weight(self) -> torch.Tensor:
        """The LM head as a (hidden, vocab) matrix (drafters that reuse the target's head read it)."""
        head = self.head
        return head.plain if head.plain is not None else self.model.get_output_embeddings().weight.detach().t()

    @property
    def embed(self) -> torch.nn.Module:
        return self.model.get_input_embeddings()

    def decode(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               cache: SlotCache) -> torch.Tensor:
        """tokens, positions (n, q) on device; mask (n, 1, q, kv_len) additive, None when every query sees every
        cached position -> final hidden (n, q, hidden)."""
        if self.fused is not None:
            return self.fused(tokens, positions, mask, cache)
        if mask is None:  # transformers would build a causal mask of its own from the cache length
            mask = torch.zeros(*tokens.shape[:1], 1, tokens.shape[1], cache.kv_len, dtype=self.dtype, device=self.device)
        return self.model.get_decoder()(input_ids=tokens, attention_mask=mask, position_ids=positions, cache=cache.for_transformers(),
                                        use_cache=True).last_hidden_state

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """fp32 logits (..., vocab) for hidden states (..., hidden)."""
        return linear(hidden, self.head).float()
