"""Rows of different lengths in one forward pass over a `SlotCache`.

Live rows occupy slots 0..n-1. Each row has a cached length; a forward pass feeds q new tokens per
row at positions length..length+q-1 and the caller then says how many of them to keep (`advance`).
"""
from __future__ import annotations

import torch

from workers.engine.decoding_model import DecodingModel
from workers.engine.kv_cache import SlotCache

PREFILL_CHUNK = 512    # tokens per row per prefill pass
PREFILL_WASTE = 0.25   # padding a prefill group may add, as a share of its rows' own tokens


class SlotRows:
    """Per-slot cached lengths over a SlotCache: where each row's next tokens go and what they may see.
    CachedLM runs the target over it, the MTP drafter its head."""

    def __init__(self, max_rows: int, capacity: int, device: torch.device, dtype: torch.dtype):
        self.cache = SlotCache(max_rows, capacity)
        self.lengths = torch.zeros(max_rows, dtype=torch.long)
        self.device, self.dtype = device, dtype

    def positions(self, n: int, q: int, start: int) -> torch.Tensor:
        """Where q new entries per row go for slots start..start+n-1: after each row's cached length (n, q)."""
        return (self.lengths[start : start + n].unsqueeze(1) + torch.arange(q)).to(self.device)

    def place(self, n: int, q: int, start: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Point the cache at q new entries per row for slots start..start+n-1, after each row's cached
        length; returns their positions (n, q) and the additive mask (n, 1, q, kv_len) on device, or None
        when none is needed (one new token per row, every row as long as the others)."""
        lengths = self.lengths[start : start + n]
        shortest, longest = int(lengths.min()), int(lengths.max())
        positions = self.positions(n, q, start)
        cache = self.cache
        cache.rows, cache.write_positions, cache.kv_len = slice(start, start + n), positions, longest + q
        cache.write_start = shortest if shortest == longest else None
        return positions, None if q == 1 and shortest == longest else self._mask(positions, longest + q)

    def _mask(self, positions: torch.Tensor, kv_len: int) -> torch.Tensor:
        """Additive (n, 1, q, kv_len) mask over the live length only: each query sees its row's cache up to itself."""
        visible = torch.arange(kv_len, device=positions.device).view(1, 1, kv_len) <= positions.unsqueeze(-1)
        mask = torch.zeros(visible.shape, dtype=self.dtype, device=positions.device)
        return mask.masked_fill_(~visible, torch.finfo(self.dtype).min).unsqueeze(1)

    def advance(self, counts: torch.Tensor, start: int = 0) -> None:
        self.lengths[start : start + len(counts)] += counts

    @torch.inference_mode()
    def move(self, src: int, dst: int) -> None:
        self.cache.move(src, dst, int(self.lengths[src]))
        self.lengths[dst] = self.lengths[src]


class CachedLM(SlotRows):
    def __init__(self, model: DecodingModel, max_rows: int, capacity: int):
        super().__init__(max_rows, capacity, model.device, model.dtype)
        self.model = model
        self.steps = model.captured_steps(self.cache, max_rows)

    @torch.inference_mode()
    def forward(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Feed `tokens` (n, q) to slots start..start+n-1; returns their final hidden states (n, q, hidden).
        Decode steps (from slot 0, narrow enough) run as a captured step where the model captures them."""
        if self.steps is not None and start == 0 and self.steps.covers(*tokens.shape):
            return self.steps(tokens.to(self.device), self.positions(*tokens.shape, start))
        positions, mask = self.place(*tokens.shape, start)
        return self.model.decode(tokens.to(self.device), positions, mask, self.cache)

    def logits(self, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """fp32 next-token logits (n, q, vocab) after feeding `tokens` (n, q)."""
        return self.model.logits(self.forward(tokens, start))

    def prefill(self, prompts: list[list[int]], start: int, chunk: int = PREFILL_CHUNK,
                waste: float = PREFILL_WASTE) -> torch.Tensor | None:
        """Cache every prompt token but the last, which the first decoding step feeds. Returns the hidden
        states of the cached tokens (n, longest - 1, hidden; padding past each row's length), None when
        no prompt has more than one token.

        Rows are fed in groups of neighbouring slots whose padding to the group's longest row stays within
        `waste` of their own tokens (callers admit rows sorted by length, so neighbours are alike), each
        group in chunks of at most `chunk` tokens per row: no prompt pays for a much longer neighbour, and
        a long prompt's attention scores never exceed chunk x its length."""
        n, width = len(prompts), max(len(p) for p in prompts) - 1
        self.lengths[start : start + n] = 0
        hidden = None
        for first, last in length_groups([len(p) - 1 for p in prompts], waste):
            group_width = max(len(p) for p in prompts[first:last]) - 1
            if group_width <= 0:
                continue
            pad = torch.tensor([p[:-1] + [p[-1]] * (group_width - len(p) + 1) for p in prompts[first:last]])
            for begin in range(0, group_width, chunk):
                out = self.forward(pad[:, begin : begin + chunk], start + first)
                if hidden is None:
                    hidden = out.new_zeros(n, width, out.shape[-1])
                hidden[first:last, begin : begin + out.shape[1]] = out
                self.lengths[start + first : start + last] += out.shape[1]
        self.lengths[start : start + n] = torch.tensor([len(p) - 1 for p in prompts])
        return hidden



def length_groups(lengths: list[int], waste: float) -> list[tuple[int, int]]:
    """Ranges [first, last) of neighbouring rows, each padded to its longest costing at most `waste` more
    tokens than its rows hold; a range grows while it stays within that."""
    groups, first = [], 0
    for i in range(1, len(lengths) + 1):
        if i == len(lengths) or _padded(lengths[first : i + 1]) > (1 + waste) * max(sum(lengths[first : i + 1]), 1):
            groups.append((first, i))
            first = i
    return groups


def _padded(lengths: list[int]) -> int:
    return max(lengths) * len(lengths)
