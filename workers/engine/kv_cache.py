"""A KV cache with one slot per batch row and a length per slot.

Rows of a speculative batch accept different numbers of tokens each step. Instead of padding or
re-computing, every row writes its new keys at its own offset; positions past a row's length are
stale (rejected drafts) and are masked out, then overwritten by the next step. Memory is fixed:
rows x (capacity + 1), allocated once per generator; the extra column is scratch, where a captured
step's padding writes (workers/engine/captured_step.py) and which no row ever reads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from transformers.cache_utils import Cache


class SlotCache:
    """The caller sets `rows` (a slice of slots) and `write_positions` (rows, q) before each forward, or
    `write_start` when every row writes at the same offset (one slice copy instead of a scatter); attention
    sees `kv_len` positions of each row. transformers' modules read it through `for_transformers()`."""

    def __init__(self, max_rows: int, capacity: int):
        self.max_rows, self.capacity = max_rows, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = slice(0, 0)
        self.write_positions: torch.Tensor | None = None
        self.write_start: int | None = None
        self.kv_len = 0
        self._transformers: Cache | None = None

    def _allocate(self, like: torch.Tensor) -> None:
        shape = (self.max_rows, like.shape[1], self.capacity + 1, like.shape[3])
        self.keys.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
        self.values.append(torch.zeros(shape, dtype=like.dtype, device=like.device))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Write this pass's keys and values (rows, kv_heads, q, head_dim) of one layer; return the layer's
        cached keys and values of the rows, `kv_len` positions each."""
        if layer_idx == len(self.keys):
            self._allocate(key_states)
        keys, values = self.keys[layer_idx][self.rows], self.values[layer_idx][self.rows]
        if self.write_start is not None:
            end = self.write_start + key_states.shape[2]
            keys[:, :, self.write_start : end] = key_states
            values[:, :, self.write_start : end] = value_states
        else:
            index = self.write_positions[:, None, :, None].expand_as(key_states)
            keys.scatter_(2, index, key_states)
            values.scatter_(2, index, value_states)
        return keys[:, :, : self.kv_len], values[:, :, : self.kv_len]

    def move(self, src: int, dst: int, length: int) -> None:
        """Copy one row's first `length` positions to another slot (keeps live rows in slots 0..n-1)."""
        for buf in (*self.keys, *self.values):
            buf[dst, :, :length] = buf[src, :, :length]

    def for_transformers(self) -> Cache:
        """This cache as a transformers `Cache`, for decoder modules the fused decoder does not replace
        (imported on first use: a worker running only the fused decoder never imports transformers)."""
        if self._transformers is None:
            from workers.engine.transformers_cache import TransformersSlotCache

            self._transformers = TransformersSlotCache(self)
        return self._transformers
