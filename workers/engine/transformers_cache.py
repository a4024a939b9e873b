"""A SlotCache seen as a transformers `Cache`: what transformers' decoder modules call while the cache's own
methods do the work (models the fused decoder does not run, the MTP head's Llama block)."""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from transformers.cache_utils import Cache

if TYPE_CHECKING:
    from workers.engine.kv_cache import SlotCache


class TransformersSlotCache(Cache):
    def __init__(self, slots: SlotCache):
        super().__init__(layers=[])
        self.slots = slots

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        return self.slots.update(key_states, value_states, layer_idx)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.slots.kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.slots.kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False
