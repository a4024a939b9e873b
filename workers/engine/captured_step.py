"""The whole decode step at static shapes, captured once per (rows, width) bucket and replayed.

A small model on a GPU spends its step launching ~40 kernels a layer, not computing: gpt-fast and vLLM
capture the step in a CUDA graph, so a pass costs one launch. A graph needs every shape and address
fixed, so here a step always feeds a bucket's rows x width (padding rows and columns), writes keys and
values by scatter at each row's positions, and attends over the cache's whole capacity under a mask
built from the positions (the live length varies; the buffer does not). Padding goes to the cache's
scratch column, one past the last position any row can reach, which no real query ever sees.

Without CUDA (tests on a CPU) the same static step runs eagerly: same buckets, same padding, same math.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F

from workers.engine.fused_decoder import FusedDecoder
from workers.engine.kv_cache import SlotCache
from workers.engine.linear import rms_norm

WIDTHS = (1, 2, 4, 8, 16)   # verify widths captured: k + 1 for k up to 15; wider passes run eagerly


def buckets(limit: int) -> list[int]:
    """Powers of two below `limit`, then `limit` itself: every row count up to it pads by less than 2x."""
    out = [1]
    while out[-1] * 2 < limit:
        out.append(out[-1] * 2)
    return sorted(set(out + [limit]))


def _bucket(n: int, sizes: list[int] | tuple[int, ...]) -> int | None:
    return next((size for size in sizes if size >= n), None)


def static_step(fused: FusedDecoder, cache: SlotCache, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """tokens, positions (rows, width) for cache slots 0..rows-1 -> final hidden states (rows, width, hidden).
    Every shape depends on (rows, width) and the cache's size alone."""
    h = fused.embed(tokens)
    cos, sin = (t.unsqueeze(2) for t in fused.rotary(h, positions))
    capacity = cache.keys[0].shape[2]
    visible = torch.arange(capacity, device=tokens.device) <= positions.unsqueeze(-1)          # (rows, width, capacity)
    mask = torch.zeros(visible.shape, dtype=h.dtype, device=h.device).masked_fill_(~visible, torch.finfo(h.dtype).min)
    mask = mask.unsqueeze(1)
    rows = tokens.shape[0]
    for index, layer in enumerate(fused.layers):
        query, key, value = fused._before_attention(h, cos, sin, layer, fused.heads, fused.kv_heads, fused.eps)
        where = positions[:, None, :, None].expand_as(key)
        keys, values = cache.keys[index][:rows], cache.values[index][:rows]
        keys.scatter_(2, where, key)
        values.scatter_(2, where, value)
        attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
        h = fused._after_attention(h, attn.transpose(1, 2).flatten(2), layer, fused.eps)
    return rms_norm(h, fused.norm, fused.eps)


class _Bucket:
    """Static input buffers of one (rows, width) bucket and the step that reads them: a replayed CUDA graph,
    or the static step called directly."""

    def __init__(self, fused: FusedDecoder, cache: SlotCache, rows: int, width: int, scratch: int,
                 pool: object | None):
        device = cache.keys[0].device
        self.tokens = torch.zeros(rows, width, dtype=torch.long, device=device)
        self.positions = torch.full((rows, width), scratch, dtype=torch.long, device=device)
        self.scratch = scratch
        run: Callable[[], torch.Tensor] = lambda: static_step(fused, cache, self.tokens, self.positions)
        if pool is None:
            self.replay = run
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):   # warm-up outside the graph: cuBLAS handles, workspaces
            for _ in range(2):
                run()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.out = run()
        self.replay = self._replay

    def _replay(self) -> torch.Tensor:
        self.graph.replay()
        return self.out

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        n, q = tokens.shape
        self.tokens.zero_()
        self.positions.fill_(self.scratch)
        self.tokens[:n, :q].copy_(tokens, non_blocking=True)
        self.positions[:n, :q].copy_(positions, non_blocking=True)
        return self.replay()[:n, :q].clone()


class CapturedSteps:
    """One static step per (rows, width) bucket of a SlotCache, built on first use. `capture`: replay CUDA
    graphs (the cache must live on a CUDA device); otherwise run the static step eagerly."""

    def __init__(self, fused: FusedDecoder, cache: SlotCache, max_rows: int, capture: bool):
        self.fused, self.cache, self.capture = fused, cache, capture
        self.rows = buckets(max_rows)
        self.buckets: dict[tuple[int, int], _Bucket] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def covers(self, rows: int, width: int) -> bool:
        """Whether a step of this shape has a bucket (and the cache is allocated)."""
        return (len(self.cache.keys) == len(self.fused.layers) and _bucket(rows, self.rows) is not None
                and _bucket(width, WIDTHS) is not None)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        key = (_bucket(tokens.shape[0], self.rows), _bucket(tokens.shape[1], WIDTHS))
        if key not in self.buckets:
            self.buckets[key] = _Bucket(self.fused, self.cache, *key, self.cache.capacity, self.pool)
        return self.buckets[key](tokens, positions)
