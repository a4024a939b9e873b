"""A job-wide suffix index: which token followed a context, how often, across every indexed stream.

A depth-limited suffix trie (SuffixDecoding, Oliaro et al. 2024): a node per distinct substring of at
most `depth` tokens, counting its occurrences, and `cont`, how many of them some token followed. A
suffix link (the node minus its first token) per node makes both growth and lookup amortised O(1)
per token: appending token t to a stream walks the link chain of the stream's tail once (`depth`
nodes), and matching a context is an Aho-Corasick scan. Continuations are ranked by frequency (the
child's count; the most recent occurrence breaks ties), so many finished rows outvote one odd row.

Nodes live in flat lists and one dict of edges keyed (node << 32 | token), about 170 bytes per node;
a stream of n tokens adds at most n * depth nodes, and finished streams are evicted oldest first once
more than `max_tokens` tokens are indexed, which bounds memory.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

ROOT = 0
_NONE = -1    # no node: no child, no sibling, or a best child not known yet


@dataclass(eq=False)
class Stream:
    """One indexed token stream (a prompt and its completion so far). Open streams grow and are never
    evicted; closed ones are evicted oldest first."""
    tokens: list[int] = field(default_factory=list)
    tail: int = ROOT    # node of the stream's longest suffix shorter than the index depth
    open: bool = True


class SuffixIndex:
    def __init__(self, max_tokens: int, depth: int = 32):
        if depth < 1 or max_tokens < 0:
            raise ValueError(f"suffix index needs depth >= 1 and max_tokens >= 0, got {depth} and {max_tokens}")
        self.max_tokens, self.depth = max_tokens, depth
        self.edges: dict[int, int] = {}
        # One entry per node id (lists: twice as fast to update as arrays here, and node ids, stored in
        # `edges` anyway, are shared rather than copied).
        self.count = [0]       # occurrences of the node's substring
        self.cont = [0]        # occurrences followed by a token (the children's counts summed)
        self.link = [ROOT]     # node of the substring without its first token
        self.level = [0]       # substring length
        self.token = [0]       # last token of the substring (the edge label)
        self.stamp = [0]       # clock of the latest occurrence: breaks frequency ties by recency
        self.best = [_NONE]    # child with the highest (count, stamp), or _NONE until looked up
        self.first = [_NONE]   # children as a doubly linked list, for recomputing `best`
        self.next = [_NONE]
        self.prev = [_NONE]
        self.free: list[int] = []
        self.closed: deque[Stream] = deque()
        self.indexed = 0                  # tokens in all streams, open and closed
        self.clock = 0

    @property
    def nodes(self) -> int:
        return len(self.edges) + 1

    # ------------------------------------------------------------------------------------------ growth

    def open(self, tokens: list[int]) -> Stream:
        stream = Stream()
        self.extend(stream, tokens)
        return stream

    def add(self, tokens: list[int]) -> None:
        """Index a finished stream."""
        self.close(self.open(tokens))

    def extend(self, stream: Stream, tokens: list[int]) -> None:
        if not stream.open:
            raise ValueError("cannot extend a closed stream")
        for t in tokens:
            self._append(stream, t)
        stream.tokens.extend(tokens)
        self.indexed += len(tokens)
        self._evict()

    def close(self, stream: Stream) -> None:
        """The stream is finished: it stays matchable until evicted, oldest first."""
        if stream.open:
            stream.open = False
            self.closed.append(stream)
            self._evict()

    def _append(self, stream: Stream, t: int) -> None:
        """Count every substring ending at the new token: a child under each node of the tail's link chain,
        deepest first, so each new child's suffix link is the next child made."""
        edges, count, cont, link, best, stamp = self.edges, self.count, self.cont, self.link, self.best, self.stamp
        self.clock = clock = self.clock + 1
        u, previous, first = stream.tail, None, None
        while True:
            key = u << 32 | t
            c = edges.get(key)
            if c is None:
                c = edges[key] = self._node(u, t, clock)
            else:
                count[c] += 1
                stamp[c] = clock
            cont[u] += 1
            b = best[u]
            if b != c and b >= 0 and count[c] >= count[b]:
                best[u] = c
            if previous is None:
                first = c
            else:
                link[previous] = c
            if u == 0:  # ROOT
                break
            previous, u = c, link[u]
        stream.tail = first if self.level[first] < self.depth else link[first]

    def _node(self, parent: int, t: int, clock: int) -> int:
        """A new child of `parent` with one occurrence, on a recycled id when one is free."""
        sibling, level = self.first[parent], self.level[parent] + 1
        if self.free:
            c = self.free.pop()
            self.count[c], self.cont[c], self.stamp[c], self.link[c] = 1, 0, clock, ROOT
            self.level[c], self.token[c] = level, t
            self.best[c] = self.first[c] = self.prev[c] = _NONE
            self.next[c] = sibling
        else:
            c = len(self.count)
            self.count.append(1)
            self.cont.append(0)
            self.stamp.append(clock)
            self.link.append(ROOT)
            self.level.append(level)
            self.token.append(t)
            self.best.append(_NONE)
            self.first.append(_NONE)
            self.prev.append(_NONE)
            self.next.append(sibling)
        if sibling != _NONE:
            self.prev[sibling] = c
        self.first[parent] = c
        return c

    # -------------------------------------------------------------------------------------------- eviction

    def _evict(self) -> None:
        while self.indexed > self.max_tokens and self.closed:
            stream = self.closed.popleft()
            self._remove(stream.tokens)
            self.indexed -= len(stream.tokens)

    def _remove(self, tokens: list[int]) -> None:
        """Undo _append for every position: decrement each substring occurrence, drop nodes that reach zero."""
        edges, count, cont, best = self.edges, self.count, self.cont, self.best
        freed = []
        for start in range(len(tokens)):
            u = ROOT
            for t in tokens[start : start + self.depth]:
                key = u << 32 | t
                c = edges[key]
                cont[u] -= 1
                count[c] -= 1
                if best[u] == c:
                    best[u] = _NONE
                if count[c] == 0:
                    del edges[key]
                    self._unlink(u, c)
                    freed.append(c)
                u = c
        self.free.extend(freed)  # only now: a node freed above may still be walked through

    def _unlink(self, parent: int, c: int) -> None:
        before, after = self.prev[c], self.next[c]
        if before == _NONE:
            self.first[parent] = after
        else:
            self.next[before] = after
        if after != _NONE:
            self.prev[after] = before

    # -------------------------------------------------------------------------------------------- lookup

    def match(self, context: list[int]) -> int:
        """Node of the longest suffix of `context` that some indexed token followed (ROOT if none)."""
        edges, link = self.edges, self.link
        u = ROOT
        for t in context[max(0, len(context) - self.depth + 1) :]:
            while True:
                c = edges.get(u << 32 | t)
                if c is not None:
                    u = c
                    break
                if u == ROOT:
                    break
                u = link[u]
        return self._back_off(u)

    def stream_match(self, stream: Stream) -> int:
        """match() for an open stream's own tokens, from its tail: O(1) amortised."""
        return self._back_off(stream.tail)

    def _back_off(self, u: int) -> int:
        while u != ROOT and self.cont[u] == 0:
            u = self.link[u]
        return u

    def propose(self, node: int, max_len: int, min_prob: float) -> list[int]:
        """Follow the most frequent continuation from `node` while the product of each step's empirical
        probability (child count / continued occurrences) stays at or above `min_prob`."""
        count, cont, link, token, best = self.count, self.cont, self.link, self.token, self.best
        out: list[int] = []
        confidence, u = 1.0, node
        while len(out) < max_len and u != ROOT:
            b = best[u]
            if b == _NONE:
                b = best[u] = self._best_child(u)
            confidence *= count[b] / cont[u]
            if confidence < min_prob:
                break
            out.append(token[b])
            u = self._back_off(b if self.level[b] < self.depth else link[b])
        return out

    def _best_child(self, u: int) -> int:
        best, key, c = _NONE, (-1, -1), self.first[u]
        while c != _NONE:
            if (self.count[c], self.stamp[c]) > key:
                best, key = c, (self.count[c], self.stamp[c])
            c = self.next[c]
        return best
