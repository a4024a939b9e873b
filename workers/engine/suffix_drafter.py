"""The job-wide suffix drafter: drafts from everything this worker has read and written in the job.

Every live row is indexed as it grows and stays indexed after it retires (until evicted), in one
SuffixIndex that the drafter keeps for its lifetime; the shard runner keeps the drafter for the
actor's, so later shards draft from earlier shards' prompts and completions, and sibling samples of
one prompt draft from each other while they run. Drafts are one-hot, so greedy and sampled output stay
exactly the target's. Proposal length follows confidence, as in SuffixDecoding: at most `spec_factor`
times the match length, and only while the cumulative empirical probability stays >= `min_prob`.
"""
from __future__ import annotations

import math

from workers.engine.drafter import COPY_PRIOR, Drafter, Proposal, Row, pack
from workers.engine.suffix_index import Stream, SuffixIndex


class SuffixDrafter(Drafter):
    name = "suffix"
    acceptance_prior = COPY_PRIOR

    def __init__(self, max_tokens: int, depth: int = 16, min_prob: float = 0.1, spec_factor: float = 1.0):
        self.index = SuffixIndex(max_tokens, depth)
        self.min_prob, self.spec_factor = min_prob, spec_factor
        self.live: dict[int, Stream] = {}  # id(row) -> its stream; rows keep their object while live

    def start(self, max_rows: int, capacity: int) -> None:
        for stream in self.live.values():  # rows of a generate() call that ended early (an exception)
            self.index.close(stream)
        self.live.clear()

    def admit(self, rows: list[Row], start: int, hidden=None) -> None:
        for row in rows:
            self.live[id(row)] = self.index.open(list(row.tokens))

    def retire(self, row: Row) -> None:
        """Index the row's last verified tokens, then keep it for later rows to draft from."""
        self.index.close(self._sync(row))
        del self.live[id(row)]

    def _sync(self, row: Row) -> Stream:
        """Index the tokens the row gained since the last call (a row only grows; a stop-string cut
        at its end keeps the indexed tokens, which the target did produce)."""
        stream = self.live[id(row)]
        self.index.extend(stream, row.tokens[len(stream.tokens) :])
        return stream

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        drafts = []
        for row, cap in zip(rows, caps):
            node = self.index.stream_match(self._sync(row))
            limit = min(k, cap, math.ceil(self.spec_factor * self.index.level[node]))
            drafts.append(self.index.propose(node, limit, self.min_prob) if limit > 0 else [])
        return pack(drafts, k)
