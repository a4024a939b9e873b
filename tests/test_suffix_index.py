"""The suffix index against a brute-force search over the raw streams.

The oracle scans every indexed stream for the longest suffix of the context that some token followed,
counts what followed it, and picks the most frequent (latest occurrence on ties); iterating that on the
context plus each drafted token, with the same confidence rule, must give the index's proposal. Small
vocabularies make long repeated matches, ties and depth-limit crossings common.
"""
from __future__ import annotations

import random

import pytest

from workers.engine.suffix_index import ROOT, SuffixIndex


class BruteForce:
    """Streams with the clock at which each token was indexed, searched exhaustively."""

    def __init__(self, depth: int):
        self.depth, self.streams, self.clock = depth, [], 0

    def extend(self, stream: int, tokens: list[int]) -> None:
        while len(self.streams) <= stream:
            self.streams.append([])
        for t in tokens:
            self.clock += 1
            self.streams[stream].append((t, self.clock))

    def next_counts(self, context: list[int]) -> tuple[int, dict[int, tuple[int, int]]]:
        """Length of the longest suffix (< depth) some token followed, and {token: (count, latest clock)}."""
        for n in range(min(self.depth - 1, len(context)), 0, -1):
            suffix, seen = context[len(context) - n :], {}
            for stream in self.streams:
                tokens = [t for t, _ in stream]
                for end in range(n, len(stream)):
                    if tokens[end - n : end] == suffix:
                        t, clock = stream[end]
                        count, latest = seen.get(t, (0, 0))
                        seen[t] = (count + 1, max(latest, clock))
            if seen:
                return n, seen
        return 0, {}

    def propose(self, context: list[int], max_len: int, min_prob: float) -> tuple[int, list[int]]:
        match, _ = self.next_counts(context)
        out, confidence, context = [], 1.0, list(context)
        while len(out) < max_len:
            n, seen = self.next_counts(context)
            if n == 0:
                break
            token = max(seen, key=lambda t: seen[t])
            confidence *= seen[token][0] / sum(c for c, _ in seen.values())
            if confidence < min_prob:
                break
            out.append(token)
            context.append(token)
        return match, out


def random_stream(rng: random.Random, vocab: int, length: int) -> list[int]:
    """Random tokens with copied spans, so that long matches and repeated continuations occur."""
    out: list[int] = []
    while len(out) < length:
        if out and rng.random() < 0.5:
            start = rng.randrange(len(out))
            out.extend(out[start : start + rng.randrange(1, 12)])
        else:
            out.append(rng.randrange(vocab))
    return out[:length]


def substring_counts(index: SuffixIndex) -> dict[tuple[int, ...], tuple[int, int]]:
    """{substring: (count, continued count)} for every node, by walking the trie."""
    out, stack = {}, [((), ROOT)]
    while stack:
        path, u = stack.pop()
        if u != ROOT:
            out[path] = (index.count[u], index.cont[u])
        c = index.first[u]
        while c != -1:
            stack.append((path + (index.token[c],), c))
            c = index.next[c]
    return out


def expected_counts(streams: list[list[int]], depth: int) -> dict[tuple[int, ...], tuple[int, int]]:
    out: dict[tuple[int, ...], tuple[int, int]] = {}
    for s in streams:
        for start in range(len(s)):
            for end in range(start + 1, min(start + depth, len(s)) + 1):
                count, cont = out.get(tuple(s[start:end]), (0, 0))
                out[tuple(s[start:end])] = (count + 1, cont + (end < len(s) and end - start < depth))
    return out


@pytest.mark.parametrize("depth", [1, 2, 5, 9])
def test_match_and_proposal_equal_brute_force(depth):
    rng = random.Random(depth)
    index, brute = SuffixIndex(max_tokens=10**9, depth=depth), BruteForce(depth)
    for i in range(12):
        stream = random_stream(rng, 4, rng.randrange(1, 50))
        index.add(stream)
        brute.extend(i, stream)
    for _ in range(300):
        context = random_stream(rng, 4, rng.randrange(0, 20))
        max_len, min_prob = rng.randrange(1, 10), rng.choice([0.0, 0.1, 0.3, 0.6])
        node = index.match(context)
        assert (index.level[node], index.propose(node, max_len, min_prob)) == brute.propose(context, max_len, min_prob)


def test_interleaved_live_streams_match_their_own_tokens_and_each_other():
    """Open streams grow in turns (as live rows do); each one's incremental match equals a search of
    its tokens, so a row sees its own prompt and output and the other rows' too."""
    rng, depth = random.Random(1), 6
    index, brute = SuffixIndex(max_tokens=10**9, depth=depth), BruteForce(depth)
    streams = [index.open([]) for _ in range(5)]
    for _ in range(200):
        i = rng.randrange(len(streams))
        tokens = random_stream(rng, 5, rng.randrange(1, 4))
        index.extend(streams[i], tokens)
        brute.extend(i, tokens)
        node = index.stream_match(streams[i])
        assert node == index.match(streams[i].tokens)
        assert (index.level[node], index.propose(node, 6, 0.1)) == brute.propose(streams[i].tokens, 6, 0.1)
    assert substring_counts(index) == expected_counts([s.tokens for s in streams], depth)


def test_eviction_keeps_memory_bounded_and_the_index_exact():
    rng, depth, max_tokens = random.Random(2), 8, 300
    index = SuffixIndex(max_tokens=max_tokens, depth=depth)
    kept: list[list[int]] = []
    for _ in range(150):
        stream = random_stream(rng, 6, rng.randrange(1, 80))
        index.add(stream)
        kept.append(stream)
        while sum(map(len, kept)) > max_tokens:
            kept.pop(0)
        assert index.indexed == sum(map(len, kept)) <= max_tokens
        assert index.nodes <= 1 + depth * max_tokens
    assert substring_counts(index) == expected_counts(kept, depth)
    assert len(index.count) < 1 + depth * max_tokens, "freed nodes are reused, so the arrays stop growing"
    for _ in range(max_tokens):  # one-token streams push everything else out
        index.add([0])
    assert index.nodes == 2


def test_open_streams_are_never_evicted():
    index = SuffixIndex(max_tokens=10, depth=4)
    live = index.open([1, 2, 3, 4, 5, 6, 7, 8])
    index.add([9, 9, 9, 9, 9, 9])
    index.extend(live, [1, 2, 3])
    assert index.indexed == len(live.tokens) == 11
    assert index.propose(index.stream_match(live), 3, 0.0) == [4, 5, 6]


def test_frequency_beats_recency_and_confidence_limits_the_length():
    index = SuffixIndex(max_tokens=1000, depth=8)
    for _ in range(3):
        index.add([7, 8, 1, 2, 3, 4])
    index.add([7, 8, 5, 6])                                  # the latest, but seen once
    node = index.match([7, 8])
    assert index.propose(node, 4, 0.0) == [1, 2, 3, 4]       # 3 of 4 occurrences, not the latest
    assert index.propose(node, 4, 0.8) == []                 # 0.75 < 0.8: not confident enough
    index.add([1, 2, 9])
    index.add([1, 2, 9])
    # after [7, 8, 1, 2] the 4-token context has seen 3 only, though [1, 2] alone more often saw 9
    assert index.propose(node, 4, 0.5) == [1, 2, 3, 4]
    # a context whose continuation splits halves the confidence; the tie goes to the latest occurrence
    index.add([4, 4, 6, 7, 8])
    index.add([4, 4, 5, 9, 10])
    node = index.match([3, 4, 4])
    assert index.level[node] == 2
    assert index.propose(node, 4, 0.4) == [5, 9, 10]         # then certain, then never continued
    assert index.propose(node, 4, 0.6) == []


def test_unknown_context_proposes_nothing():
    index = SuffixIndex(max_tokens=100, depth=4)
    index.add([1, 2, 3])
    assert index.match([]) == ROOT and index.match([5, 6]) == ROOT
    assert index.propose(ROOT, 4, 0.0) == []
    assert index.match([1, 2, 3]) == ROOT, "nothing ever followed [3], [2, 3] or [1, 2, 3]"
    assert [index.level[index.match(c)] for c in ([1, 2], [5, 2], [3, 1])] == [2, 1, 1]
