"""Prompt lookup: propose what followed the latest earlier occurrence of the row's last n tokens.

How long a match is says much of how far its copy will be accepted: on the suite's tune half a draft after a
3-token match was accepted at its first position 0.82 of the time, after a 2-token match 0.48, after a 1-token
match (three steps in four) 0.22. So the drafter learns, per match length and draft position, how often its
drafts were accepted, and reports that as each draft's confidence: the controller's confidence stop
(workers/engine/draft_stop.py) then cuts a weak match's draft short and lets a strong one run, step by step,
where a per-row offer alone could only follow the row's average.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engine.drafter import COPY_PRIOR, Drafter, Proposal, Row, pack

# Conditional acceptance a match length starts from, before its drafts are counted (tune half, pooled and
# rounded): position 1 by match length 1, 2, 3+; later positions COPY_PRIOR's.
FIRST_POSITION_PRIOR = (0.2, 0.5, 0.8)


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


@dataclass
class _Draft:
    """A row's last proposal: where it started, its tokens and the match length it copied after."""
    start: int
    tokens: list[int]
    match: int


class MatchOdds:
    """Decayed counts of draft positions accepted given the one before, per match length (1..size): learnt from
    the tokens each row went on to generate, so a draft cut short or only guessed counts as well (a one-hot
    draft is accepted exactly when it equals the target's token, greedy or sampled). Python lists: a few
    numbers per row and step, where a numpy call costs more than the arithmetic."""

    def __init__(self, size: int, max_k: int = 16, prior_tries: float = 4.0, decay: float = 0.995):
        first = [FIRST_POSITION_PRIOR[min(n, len(FIRST_POSITION_PRIOR)) - 1] for n in range(1, size + 1)]
        self.tries = [[prior_tries] * max_k for _ in range(size)]
        self.hits = [[prior_tries * p] + [prior_tries * COPY_PRIOR[1][-1]] * (max_k - 1) for p in first]
        self.decay = decay

    def odds(self, match: int, k: int) -> list[float]:
        """P(position j accepted | j - 1 accepted) for j = 1..k of a draft after a match of length `match`."""
        hits, tries = self.hits[match - 1], self.tries[match - 1]
        last = len(tries) - 1
        return [hits[min(j, last)] / tries[min(j, last)] for j in range(k)]

    def count(self, draft: _Draft, tokens: list[int]) -> None:
        """Count the positions of `draft` that the row's tokens now settle: accepted up to the first miss."""
        hits, tries = self.hits[draft.match - 1], self.tries[draft.match - 1]
        known = min(len(tokens) - draft.start, len(draft.tokens), len(tries))
        for j in range(known):
            accepted = tokens[draft.start + j] == draft.tokens[j]
            hits[j] = self.decay * hits[j] + accepted
            tries[j] = self.decay * tries[j] + 1.0
            if not accepted:
                return


class NgramDrafter(Drafter):
    """Searches the row's prompt and output so far, longest n first. Model-free; costs microseconds."""

    name = "ngram"
    acceptance_prior = COPY_PRIOR

    def __init__(self, ngram_size: int = 3):
        self.ngram_size = ngram_size
        self.indexes: list[_NgramIndex] = []
        self.drafts: list[_Draft | None] = []
        self.odds = MatchOdds(ngram_size)   # lives across generate calls, as the worker does

    def start(self, max_rows: int, capacity: int) -> None:
        self.indexes = [_NgramIndex(self.ngram_size) for _ in range(max_rows)]
        self.drafts = [None] * max_rows

    def admit(self, rows: list[Row], start: int, hidden=None) -> None:
        for slot in range(start, start + len(rows)):
            self.indexes[slot], self.drafts[slot] = _NgramIndex(self.ngram_size), None

    def move(self, src: int, dst: int) -> None:
        self.indexes[dst], self.drafts[dst] = self.indexes[src], self.drafts[src]

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        drafts, confidence = [], [[0.0] * k for _ in rows]
        for slot, (row, cap) in enumerate(zip(rows, caps)):
            tokens, index, last = row.tokens, self.indexes[slot], self.drafts[slot]
            if last is not None:
                self.odds.count(last, tokens)
            index.extend(tokens, len(tokens) - 1)  # never match the suffix with itself
            found: list[int] = []
            for n in range(min(self.ngram_size, len(tokens) - 1), 0, -1):
                end = index.last_end.get(tuple(tokens[-n:]))
                if end is not None:
                    found = tokens[end + 1 : end + 1 + min(k, cap)]
                    confidence[slot][: len(found)] = self.odds.odds(n, len(found))
                    break
            self.drafts[slot] = _Draft(len(tokens), found, n) if found else None
            drafts.append(found)
        proposal = pack(drafts, k)
        proposal.confidence = torch.tensor(confidence, dtype=torch.float64).view(len(rows), k)
        return proposal
