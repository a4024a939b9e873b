"""A KV cache with one slot per batch row and a length per slot.

Rows of a speculative batch accept different numbers of tokens each step. Instead of padding or
re-computing, every row writes its new keys at its own offset; positions past a row's length are
stale (rejected drafts) and are masked out, then overwritten by the next step. Memory is fixed:
rows x (capacity + 1), allocated once per generator; the extra column is scratch, where a captured
step's padding writes (workers/engine/captured_step.py) and which no row ever reads.
"""
from __future__ import annotations

import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """Drop-in `transformers` cache. The caller sets `rows` (a slice of slots) and `write_positions`
    (rows, q) before each forward, or `write_start` when every row writes at the same offset (one slice
    copy instead of a scatter); attention sees `kv_len` positions of each row."""

    def __init__(self, max_rows: int, capacity: int):
        super().__init__(layers=[])
        self.max_rows, self.capacity = max_rows, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.rows = slice(0, 0)
        self.write_positions: torch.Tensor | None = None
        self.write_start: int | None = None
        self.kv_len = 0

    def _allocate(self, like: torch.Tensor) -> None:
        shape = (self.max_rows, like.shape[1], self.capacity + 1, like.shape[3])
        self.keys.append(torch.zeros(shape, dtype=like.dtype, device=like.device))
        self.values.append(torch.zeros(shape, dtype=like.dtype, device=like.device))

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
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

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.kv_len

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.kv_len, 0

    @property
    def is_compileable(self) -> bool:
        return False

