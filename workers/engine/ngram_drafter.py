"""Prompt lookup: propose what followed the latest earlier occurrence of the row's last n tokens."""
from __future__ import annotations

from dataclasses import dataclass, field

from workers.engine.drafter import COPY_PRIOR, Drafter, Proposal, Row, pack


@dataclass
class _NgramIndex:
    """Latest end position of every n-gram (n <= size) of one row, indexed incrementally."""
    size: int
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int], upto: int) -> None:
        for end in range(self.indexed, upto):
            for n in range(1, min(self.size, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, upto)


class NgramDrafter(Drafter):
    """Searches the row's prompt and output so far, longest n first. Model-free; costs microseconds."""

    name = "ngram"
    acceptance_prior = COPY_PRIOR

    def __init__(self, ngram_size: int = 3):
        self.ngram_size = ngram_size
        self.indexes: list[_NgramIndex] = []

    def start(self, max_rows: int, capacity: int) -> None:
        self.indexes = [_NgramIndex(self.ngram_size) for _ in range(max_rows)]

    def admit(self, rows: list[Row], start: int, hidden=None) -> None:
        for slot in range(start, start + len(rows)):
            self.indexes[slot] = _NgramIndex(self.ngram_size)

    def move(self, src: int, dst: int) -> None:
        self.indexes[dst] = self.indexes[src]

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        drafts = []
        for slot, (row, cap) in enumerate(zip(rows, caps)):
            tokens, index = row.tokens, self.indexes[slot]
            index.extend(tokens, len(tokens) - 1)  # never match the suffix with itself
            found: list[int] = []
            for n in range(min(self.ngram_size, len(tokens) - 1), 0, -1):
                end = index.last_end.get(tuple(tokens[-n:]))
                if end is not None:
                    found = tokens[end + 1 : end + 1 + min(k, cap)]
                    break
            drafts.append(found)
        return pack(drafts, k)
