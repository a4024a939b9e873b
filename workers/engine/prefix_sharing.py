"""Prefill once per prefix: which new rows copy which cached rows' keys and values, and in what order.

Samples of one prompt repeat it whole; templated prompts repeat a fixed head. The cache already holds
every live row's prompt, so a new row copies the longest prompt prefix it shares with a live row (or
with a new row prefilled before it) and computes only the rest. New rows are prefilled in three
rounds, each a contiguous range of slots:
  0. one row of each group of new prompts that share a prefix (the group's shared head is computed once);
  1. the other distinct prompts, each after copying its longest shared prefix from live rows or round 0;
  2. repeats of a prompt already prefilled (further samples), which copy it whole.
This is SGLang's radix attention scoped to one batch's slots: no extra memory, since sources are rows
the cache holds anyway.
"""
from __future__ import annotations

import bisect
from dataclasses import dataclass

MIN_SHARED = 8   # tokens: a shorter common prefix is recomputed rather than copied


@dataclass(frozen=True)
class Source:
    slot: int      # the slot whose cached prompt to copy
    length: int    # how many leading positions


@dataclass
class PrefillPlan:
    order: list[int]                 # new rows in slot order (indexes into the prompts given)
    rounds: list[int]                # sizes of the consecutive rounds, in slot order
    sources: list[Source | None]     # per row in slot order: what it copies before computing the rest


def common_prefix(a: tuple[int, ...], b: tuple[int, ...]) -> int:
    n = min(len(a), len(b))
    if a[:n] == b[:n]:
        return n
    low, high = 0, n   # a[:low] == b[:low], a[:high] != b[:high]: bisect on C-speed slice compares
    while high - low > 1:
        mid = (low + high) // 2
        low, high = (mid, high) if a[:mid] == b[:mid] else (low, mid)
    return low


class _Sources:
    """Cached prompts by slot, sorted, so the longest shared prefix is found next to a prompt's sort position."""

    def __init__(self, cached: dict[int, tuple[int, ...]]):
        self.keys = sorted((tokens, slot) for slot, tokens in cached.items())

    def add(self, slot: int, tokens: tuple[int, ...]) -> None:
        bisect.insort(self.keys, (tokens, slot))

    def best(self, tokens: tuple[int, ...]) -> Source | None:
        at = bisect.bisect_left(self.keys, (tokens, -1))
        found = [Source(slot, common_prefix(tokens, key)) for key, slot in self.keys[max(at - 1, 0) : at + 1]]
        best = max(found, key=lambda s: s.length, default=None)
        return best if best is not None and best.length >= MIN_SHARED else None


def plan_prefill(cached: list[tuple[int, ...]], live: dict[int, tuple[int, ...]], start: int) -> PrefillPlan:
    """`cached`: what each new row must cache (its prompt but the last token); `live`: slot -> cached prompt
    of the rows already in the cache; new rows take slots start, start + 1, ..."""
    by_tokens = sorted(range(len(cached)), key=lambda i: cached[i])
    first, repeats = [], []
    for position, i in enumerate(by_tokens):
        (repeats if position and cached[by_tokens[position - 1]] == cached[i] else first).append(i)
    heads = [i for position, i in enumerate(first)
             if position + 1 < len(first) and common_prefix(cached[i], cached[first[position + 1]]) >= MIN_SHARED
             and (position == 0 or common_prefix(cached[i], cached[first[position - 1]]) < MIN_SHARED)]
    rest = [i for i in first if i not in set(heads)]
    sources, known, order, rounds = [], _Sources(live), [], []
    for group in (heads, rest, repeats):
        group = sorted(group, key=lambda i: len(cached[i]))   # neighbours alike in length pad little
        picked = [known.best(cached[i]) for i in group]
        for offset, i in enumerate(group):
            known.add(start + len(order) + offset, cached[i])
        order += group
        sources += picked
        rounds.append(len(group))
    return PrefillPlan(order, [r for r in rounds if r], sources)
