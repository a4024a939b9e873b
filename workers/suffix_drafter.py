"""The job-wide suffix drafter: drafts from everything this worker has read and written in the job.

Every live row is indexed as it grows and stays indexed after it finishes (until evicted), in one
SuffixIndex that the drafter keeps for its lifetime; the shard runner keeps the drafter for the
actor's, so later shards draft from earlier shards' prompts and completions, and sibling samples of
one prompt draft from each other. Drafts are one-hot, so greedy and sampled output stay exactly the
target's. Proposal length follows confidence, as in SuffixDecoding: at most `spec_factor` times the
match length, and only while the cumulative empirical probability stays at or above `min_prob`.
"""
from __future__ import annotations

import math

from workers.drafters import Proposal, Row, pack
from workers.suffix_index import Stream, SuffixIndex


class SuffixDrafter:
    passes_per_token = 0

    def __init__(self, max_tokens: int, depth: int = 32, min_prob: float = 0.1, spec_factor: float = 1.0):
        self.index = SuffixIndex(max_tokens, depth)
        self.min_prob, self.spec_factor = min_prob, spec_factor
        self.streams: list[Stream | None] = []

    def start(self, max_rows: int, capacity: int) -> None:
        for slot in range(len(self.streams)):
            self._close(slot)
        self.streams = [None] * max_rows

    def admit(self, rows: list[Row], start: int) -> None:
        for slot, row in enumerate(rows, start):
            self._close(slot)
            self.streams[slot] = self.index.open(list(row.tokens))

    def move(self, src: int, dst: int) -> None:
        self._close(dst)
        self.streams[dst], self.streams[src] = self.streams[src], None

    def retire(self, slot: int, row: Row) -> None:
        """A row finished: index its last verified tokens, then keep it for later rows to draft from."""
        self._sync(slot, row)
        self._close(slot)

    def _close(self, slot: int) -> None:
        stream = self.streams[slot]
        if stream is not None:
            self.index.close(stream)
            self.streams[slot] = None

    def _sync(self, slot: int, row: Row) -> Stream:
        """Index the tokens the row gained since the last call (rows only grow while live)."""
        stream = self.streams[slot]
        self.index.extend(stream, row.tokens[len(stream.tokens) :])
        return stream

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        drafts = []
        for slot, (row, cap) in enumerate(zip(rows, caps)):
            node = self.index.stream_match(self._sync(slot, row))
            limit = min(k, cap, math.ceil(self.spec_factor * self.index.level[node]))
            drafts.append(self.index.propose(node, limit, self.min_prob) if limit > 0 else [])
        return pack(drafts, k)
