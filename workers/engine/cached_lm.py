"""Rows of different lengths in one forward pass over a `SlotCache`.

Live rows occupy slots 0..n-1. Each row has a cached length; a forward pass feeds q new tokens per
row at positions length..length+q-1 and the caller then says how many of them to keep (`advance`).
"""
from __future__ import annotations

import torch

from workers.engine.decoding_model import DecodingModel
from workers.engine.kv_cache import SlotCache
from workers.engine.prefix_sharing import PrefillPlan, plan_prefill

PREFILL_CHUNK = 512    # tokens per row per prefill pass
PREFILL_WASTE = 0.25   # padding a prefill group may add, as a share of its rows' own tokens


class SlotRows:
    """Per-slot cached lengths over a SlotCache: where each row's next tokens go and what they may see.
    CachedLM runs the target over it, the MTP drafter its head."""

    def __init__(self, max_rows: int, capacity: int, device: torch.device, dtype: torch.dtype):
        self.cache = SlotCache(max_rows, capacity)
        self.lengths = torch.zeros(max_rows, dtype=torch.long)
        self.prompts: list[tuple[int, ...]] = [()] * max_rows   # per slot: the prompt tokens its cache holds
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
        self.lengths[dst], self.prompts[dst] = self.lengths[src], self.prompts[src]


class CachedLM(SlotRows):
    def __init__(self, model: DecodingModel, max_rows: int, capacity: int):
        super().__init__(max_rows, capacity, model.device, model.dtype)
        self.model = model
        self.computed_tokens = 0   # prompt tokens prefill computed (the rest were copied)
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

    def plan(self, prompts: list[list[int]], start: int) -> PrefillPlan:
        """Slot order and prefix sources for new rows entering slots start.. (see prefix_sharing)."""
        return plan_prefill([tuple(p[:-1]) for p in prompts], {s: self.prompts[s] for s in range(start)}, start)

    @torch.inference_mode()
    def prefill(self, prompts: list[list[int]], start: int, plan: PrefillPlan | None = None,
                chunk: int = PREFILL_CHUNK, waste: float = PREFILL_WASTE) -> torch.Tensor | None:
        """Cache every prompt token but the last, which the first decoding step feeds.

        With a `plan` (prompts in its slot order), each round of rows first copies the prefix its source
        shares, then computes the rest; returns None. Without one, every token is computed and the hidden
        states of the cached tokens come back (n, longest - 1, hidden; padding past each row's length),
        None when no prompt has more than one token (drafters that read prompt states need them)."""
        n = len(prompts)
        plan = plan or PrefillPlan(list(range(n)), [n], [None] * n)
        self.lengths[start : start + n] = 0
        first, hidden = 0, None
        for size in plan.rounds:
            for slot in range(start + first, start + first + size):
                source = plan.sources[slot - start]
                if source is not None:
                    self.cache.move(source.slot, slot, source.length)
                    self.lengths[slot] = source.length
            hidden = self._feed(prompts[first : first + size], start + first, chunk, waste)
            first += size
        for slot, p in enumerate(prompts, start):
            self.prompts[slot] = tuple(p[:-1])
        return hidden if len(plan.rounds) == 1 and not any(plan.sources) else None

    def _feed(self, prompts: list[list[int]], start: int, chunk: int, waste: float) -> torch.Tensor | None:
        """Compute each row's prompt from its cached length to its last token but one.

        Rows are fed in groups of neighbouring slots whose padding to the group's longest row stays within
        `waste` of their own tokens (callers admit rows sorted by length, so neighbours are alike), each
        group in chunks of at most `chunk` tokens per row: no prompt pays for a much longer neighbour, and
        a long prompt's attention scores never exceed chunk x its length. Returns the fed tokens' hidden
        states (n, longest fed, hidden), None when no row had any."""
        n = len(prompts)
        done = self.lengths[start : start + n].tolist()
        todo = [p[cached:-1] for p, cached in zip(prompts, done)]
        self.computed_tokens += sum(len(t) for t in todo)
        hidden = None
        for first, last in length_groups([len(t) for t in todo], waste):
            group_width = max(len(t) for t in todo[first:last])
            if group_width <= 0:
                continue
            pad = torch.tensor([t + [p[-1]] * (group_width - len(t)) for t, p in zip(todo[first:last], prompts[first:last])])
            for begin in range(0, group_width, chunk):
                out = self.forward(pad[:, begin : begin + chunk], start + first)
                if hidden is None:
                    hidden = out.new_zeros(n, max(len(t) for t in todo), out.shape[-1])
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
