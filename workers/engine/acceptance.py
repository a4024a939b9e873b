"""Per-slot, per-position probabilities of what a draft does, learnt from counts and quick to follow a change.

Two events per draft position j (1-based), each a Bernoulli trial: the drafter REACHES j (it proposes
position j, given it was offered j and proposed j - 1: an n-gram may find no match, a confidence stop
may end the draft) and the target ACCEPTS j (given j was proposed and j - 1 accepted). Estimates are
decayed hits / tries over a prior worth `prior_tries` tries. Each position has a prior of its own (a
drafter that matched position 1 usually goes on: the conditional odds deeper in a draft are higher),
lifted or lowered by as much as the slot's estimate beat or missed the prior at the position before
(a copied span rarely gets worse as it goes on), so positions not tried yet are judged by the last ones
that were. Position 1 (whether the row drafts usefully at all) takes its prior
lightly (`prior_tries`); later positions lean on the position before harder (`chain_tries`), since
one miss deep in a copied span says little about the span.

Each slot keeps its counts at several time scales at once (a fast decay follows a copy span that starts
or ends within a few steps; a slow one is steady on a stationary row) and mixes them by how well each
predicted the slot's recent steps, with a fixed share passed between them every step so that the other
scale can take over when the row changes phase (Herbster & Warmuth's fixed-share experts).

Above the slots' scales there may be a pooled level: every slot's trials counted together (the
worker's estimate), which is then the slots' prior. The levels form one chain, most general first: the
pooled level's prior is the given prior, the slowest scale's is the pooled level's estimate, each faster
scale's the next slower one's, each lifted position by position as above. A level's estimate at
position j needs its own at j - 1 and the level above's at j and j - 1, so all levels advance together
along anti-diagonals (`_chained`): the per-position loop that a step cannot avoid runs max_k + levels - 1
times, not max_k times per level.
"""
from __future__ import annotations

import functools

import numpy as np

REACH, ACCEPT = 0, 1


class Estimates:
    """Estimates of the first n slots. `decays` and `prior_tries` are per scale, fastest first; `pooled`
    (decay, prior tries) also keeps the pooled level, the slots' prior."""

    def __init__(self, max_rows: int, max_k: int, decays: tuple[float, ...], prior_tries: tuple[float, ...],
                 chain_tries: float = 2.0, share: float = 0.05, idle_decay: float = 0.99,
                 pooled: tuple[float, float] | None = None):
        self.decays = np.array(decays).reshape(-1, 1, 1, 1)
        self.share, self.idle_decay = share, idle_decay
        self.hits = np.zeros((len(decays), max_rows, 2, max_k))
        self.tries = np.zeros_like(self.hits)
        self.weight = np.full((max_rows, len(decays)), 1.0 / len(decays))
        self.pooled_decay = None if pooled is None else pooled[0]
        self.pooled_hits = np.zeros((1, 1, 2, max_k))
        self.pooled_tries = np.zeros_like(self.pooled_hits)
        # (levels, max_k, 1, 1), most general first: the tries a position's prior is worth (position 1's own,
        # then the chain's)
        first = ([] if pooled is None else [pooled[1]]) + list(prior_tries)[::-1]
        self.worth = np.full((len(first), max_k, 1, 1), float(chain_tries))
        self.worth[:, 0, 0, 0] = first
        self._last: tuple[tuple[int, bytes], np.ndarray] | None = None  # a step asks twice for the same state
        self._anchor: tuple[bytes, np.ndarray | None] = (b"", None)      # the prior's odds (max_k, 1, 2)

    def levels(self, n: int, prior: np.ndarray) -> np.ndarray:
        """(levels, max_k, n, 2): the pooled level's estimates (when kept), then each scale's, slowest first;
        `prior` (2, max_k) is the prior per position (a (2,) prior holds for every position).

        The most general level takes each position's prior shifted (in log-odds) by as much as its estimate
        differs from the prior at the position before: a slot that copies is trusted further along the span
        than the prior, one that misses less (with one prior for every position, this is the estimate of the
        position before). Each level below does the same with the level above's estimates as its prior: a
        row that has just started copying is trusted further along the span at once, while a position that
        failed stays remembered as failed."""
        prior = np.asarray(prior, float)
        key = (n, prior.tobytes())
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        hits, tries = self.hits[::-1, :n], self.tries[::-1, :n]
        if self.pooled_decay is not None:
            shape = (1, n) + hits.shape[2:]
            hits = np.concatenate([np.broadcast_to(self.pooled_hits, shape), hits])
            tries = np.concatenate([np.broadcast_to(self.pooled_tries, shape), tries])
        scale = 1.0 / (tries.transpose(0, 3, 1, 2) + self.worth)
        counted = hits.transpose(0, 3, 1, 2) * scale                        # estimate = counted + worth * scale * prior
        if self._anchor[0] != key[1]:
            self._anchor = (key[1], _odds(np.broadcast_to(prior.reshape(2, -1), (2, self.worth.shape[1])).T[:, None]))
        out = _chained(counted, counted + self.worth * scale, self._anchor[1])
        self._last = (key, out)
        return out

    def scales(self, n: int, prior: np.ndarray) -> np.ndarray:
        """(scales, n, 2, max_k): each scale's estimates, in the order of `decays`."""
        return self.levels(n, prior)[: -len(self.decays) - 1 : -1].transpose(0, 2, 3, 1)

    def mixed(self, n: int, prior: np.ndarray) -> np.ndarray:
        """(n, 2, max_k): the scales' estimates mixed by their weights."""
        return np.einsum("sn...,ns->n...", self.scales(n, prior), self.weight[:n])

    def observe(self, hits: np.ndarray, tries: np.ndarray, prior: np.ndarray) -> None:
        """The trials (m, n, 2, max_k) of m steps, in order, of the first n slots: reweigh the scales by how
        likely each found them (as the estimates stood before the first of them), then count them. One step
        (m = 1) is the exact online update; a controller that holds its offers folds the steps since it last
        planned at once."""
        m, n = hits.shape[:2]
        if len(self.decays) > 1:   # one scale keeps its weight of 1
            p = np.clip(self.scales(n, prior), 0.01, 0.99)
            hit, tried = hits.sum(0), tries.sum(0)
            loglik = (hit * np.log(p) + (tried - hit) * np.log1p(-p)).sum(axis=(2, 3)).T        # (n, scales)
            weight = self.weight[:n] * np.exp(loglik - loglik.max(axis=1, keepdims=True))
            weight /= weight.sum(axis=1, keepdims=True)
            share = 1 - (1 - self.share) ** m
            self.weight[:n] = (1 - share) * weight + share / weight.shape[1]
        # a position not tried forgets slowly
        decay = np.where(tries[:, None] > 0, self.decays, self.idle_decay)                   # (m, scales, n, 2, K)
        self.hits[:, :n], self.tries[:, :n] = _decayed(decay, (self.hits[:, :n], hits[:, None]),
                                                       (self.tries[:, :n], tries[:, None]))
        if self.pooled_decay is not None:
            hits, tries = hits.sum(1), tries.sum(1)
            decay = np.where(tries > 0, self.pooled_decay, self.idle_decay)
            self.pooled_hits, self.pooled_tries = _decayed(decay, (self.pooled_hits, hits), (self.pooled_tries, tries))
        self._last = None

    def reset(self, start: int, count: int) -> None:
        """Slots start.. hold new rows. Their estimates at every level are the pooled level's (their own counts
        are zero, so each level takes the level above's estimate, clipped as every prior is): patched into the
        cached levels, so a step that admits rows does not recompute the rest."""
        self.hits[:, start : start + count] = 0.0
        self.tries[:, start : start + count] = 0.0
        self.weight[start : start + count] = 1.0 / self.weight.shape[1]
        if self._last is not None and self.pooled_decay is not None:
            levels = self._last[1]
            levels[1:, :, start : start + count] = np.clip(levels[:1, :, start : start + count], 1e-3, 1 - 1e-3)
        else:
            self._last = None

    def move(self, src: int, dst: int) -> None:
        self.hits[:, dst], self.tries[:, dst] = self.hits[:, src], self.tries[:, src]
        self.weight[dst] = self.weight[src]
        if self._last is not None and max(src, dst) < self._last[0][0]:
            self._last[1][:, :, dst] = self._last[1][:, :, src]
        else:
            self._last = None


def _decayed(decay: np.ndarray, *counts: tuple[np.ndarray, np.ndarray]) -> list[np.ndarray]:
    """Each (counts, new) pair's counts after the m steps of new (m, ...) in turn: counts * decay[t] + new[t]."""
    if len(decay) == 1:
        return [now * decay[0] + new[0] for now, new in counts]
    later = np.cumprod(decay[::-1], axis=0)[::-1]                   # decay[t] * ... * decay[m - 1]
    return [now * later[0] + (new[:-1] * later[1:]).sum(0) + new[-1] for now, new in counts]


_LOW, _HIGH = 1e-3 / (1 - 1e-3), (1 - 1e-3) / 1e-3   # odds of 0.001 and 0.999: no estimate is taken as certain


def _odds(p: np.ndarray) -> np.ndarray:
    """p / (1 - p), p clipped to [0.001, 0.999] first."""
    p = np.minimum(np.maximum(p, 1e-3), 1 - 1e-3)
    return p / (1 - p)


def _chained(counted: np.ndarray, stay: np.ndarray, anchor: np.ndarray) -> np.ndarray:
    """Estimates (levels, max_k, ...) of chained levels, counted + (stay - counted) * prior each, where level
    l's prior at position j has the odds of the level above's estimate at j (the anchor's for the first
    level) times those of level l's own estimate at j - 1 over the level above's at j - 1: the log-odds
    lift, as a product of odds.

    Level l at position j needs the level above at j and j - 1 and itself at j - 1, so step s computes
    every level l at position s - l from the two steps before it: the arrays are skewed so that step s's
    positions are one slice (padding outside a level's positions is an estimate of 1/2: odds 1). With z a
    prior's odds, the estimate is p = (counted + stay z) / (1 + z) and its odds p / (1 - p) are
    (counted + stay z) / (1 + z - counted - stay z), clipped; the estimates follow from every z at once
    after the loop."""
    levels, k = counted.shape[:2]
    steps = k + levels - 1
    c = np.full((steps, levels) + counted.shape[2:], 0.5)
    st = c.copy()
    for level in range(levels):
        c[level : level + k, level], st[level : level + k, level] = counted[level], stay[level]
    odds = np.ones((steps + 2, levels + 1) + counted.shape[2:])   # step s in row s + 2; column 0: the anchor
    odds[1 : k + 1, 0] = anchor
    z = np.empty_like(c)
    for s, (cs, sts, zs) in enumerate(zip(c, st, z)):
        np.multiply(odds[s + 1, :-1] / odds[s, :-1], odds[s + 1, 1:], out=zs)
        num = sts * zs
        num += cs
        np.minimum(np.maximum(num / (1 + zs - num), _LOW), _HIGH, out=odds[s + 2, 1:])
    out = (c + st * z) / (1 + z)
    return np.stack([out[level : level + k, level] for level in range(levels)])


def trials(offered: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """(hits, tries), each (..., 2, max_k), from positions offered, drafted and accepted (...) per row (and
    step): position j is tried for REACH when offered and j - 1 was drafted, hit when drafted; tried for
    ACCEPT when drafted and j - 1 was accepted, hit when accepted. Read from a table of every triple: one
    numpy call instead of ten (each costs 10-20 us after a pass)."""
    counts = _trial_table(max_k)[offered, drafted, accepted]
    return counts[..., 0, :, :], counts[..., 1, :, :]


@functools.cache
def _trial_table(max_k: int) -> np.ndarray:
    """(max_k + 1, max_k + 1, max_k + 1, 2, 2, max_k): hits, then tries, of each (offered, drafted, accepted)."""
    offered, drafted, accepted = np.meshgrid(*[np.arange(max_k + 1)] * 3, indexing="ij")
    position = np.arange(max_k)
    past = np.stack([offered, drafted, accepted], axis=-1)[..., None] > position     # (..., 3, max_k)
    reached = np.stack([drafted, accepted], axis=-1)[..., None] >= position          # j - 1 drafted, accepted
    tries = past[..., :2, :] & reached
    return np.stack([past[..., 1:, :] & tries, tries], axis=-3).astype(float)
