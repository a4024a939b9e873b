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
"""
from __future__ import annotations

import numpy as np

REACH, ACCEPT = 0, 1


class Estimates:
    def __init__(self, max_rows: int, max_k: int, decays: tuple[float, ...], prior_tries: tuple[float, ...],
                 chain_tries: float = 2.0, share: float = 0.05, idle_decay: float = 0.99):
        self.decays = np.array(decays).reshape(-1, 1, 1, 1)
        self.prior_tries, self.chain_tries = np.array(prior_tries).reshape(-1, 1, 1), chain_tries
        self.share, self.idle_decay = share, idle_decay
        self.hits = np.zeros((len(decays), max_rows, 2, max_k))
        self.tries = np.zeros_like(self.hits)
        self.weight = np.full((max_rows, len(decays)), 1.0 / len(decays))
        self._last: tuple[tuple[int, bytes], np.ndarray] | None = None  # a step asks twice for the same state

    def scales(self, n: int, prior: np.ndarray) -> np.ndarray:
        """(scales, n, 2, max_k) estimates of the first n slots; `prior` (2, max_k) is the prior per position
        (a (2,) prior holds for every position).

        The slowest scale (the last) takes each position's prior shifted (in log-odds) by as much as the
        slot's estimate differs from the prior at the position before: a slot that copies is trusted further
        along the span than the prior, one that misses less (with one prior for every position, this is the
        estimate of the position before). A faster scale's prior is the slowest scale's estimate, shifted
        by as much as the faster scale differs from it at the position before: a row that has just started
        copying is trusted further along the span at once, while a position that failed stays remembered
        as failed."""
        key = (n, np.asarray(prior, float).tobytes())
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        hits, tries = self.hits[:, :n], self.tries[:, :n]
        weights = [self.prior_tries] + [np.full_like(self.prior_tries, self.chain_tries)] * (hits.shape[-1] - 1)
        out = np.empty_like(hits)
        prior = _logit(np.broadcast_to(np.asarray(prior, float).reshape(2, -1), (2, hits.shape[-1])))
        lift = np.zeros(hits.shape[1:-1])
        for j, m in enumerate(weights):
            before = 1.0 / (1.0 + np.exp(-(prior[:, j] + lift)))
            out[-1, ..., j] = (hits[-1, ..., j] + m[-1] * before) / (tries[-1, ..., j] + m[-1])
            lift = _logit(out[-1, ..., j]) - prior[:, j]
        shift = np.zeros_like(out[:-1, ..., 0])
        for j, m in enumerate(weights):
            slow = _logit(out[-1, ..., j])
            prior_j = 1.0 / (1.0 + np.exp(-(slow + shift)))
            out[:-1, ..., j] = (hits[:-1, ..., j] + m[:-1] * prior_j) / (tries[:-1, ..., j] + m[:-1])
            shift = _logit(out[:-1, ..., j]) - slow
        self._last = (key, out)
        return out

    def mixed(self, n: int, prior: np.ndarray) -> np.ndarray:
        """(n, 2, max_k): the scales' estimates mixed by their weights."""
        return np.einsum("sn...,ns->n...", self.scales(n, prior), self.weight[:n])

    def observe(self, hits: np.ndarray, tries: np.ndarray, prior: np.ndarray) -> None:
        """One step's trials (n, 2, max_k) of the first n slots: reweigh the scales by how likely each
        found them, then count them."""
        n = len(hits)
        p = np.clip(self.scales(n, prior), 0.01, 0.99)
        loglik = (hits * np.log(p) + (tries - hits) * np.log1p(-p)).sum(axis=(2, 3)).T        # (n, scales)
        weight = self.weight[:n] * np.exp(loglik - loglik.max(axis=1, keepdims=True))
        weight /= weight.sum(axis=1, keepdims=True)
        self.weight[:n] = (1 - self.share) * weight + self.share / weight.shape[1]
        decay = np.where(tries > 0, self.decays, self.idle_decay)  # a position not tried forgets slowly
        self.hits[:, :n] = self.hits[:, :n] * decay + hits
        self.tries[:, :n] = self.tries[:, :n] * decay + tries
        self._last = None

    def reset(self, start: int, count: int) -> None:
        self.hits[:, start : start + count] = 0.0
        self.tries[:, start : start + count] = 0.0
        self.weight[start : start + count] = 1.0 / self.weight.shape[1]
        self._last = None

    def move(self, src: int, dst: int) -> None:
        self.hits[:, dst], self.tries[:, dst] = self.hits[:, src], self.tries[:, src]
        self.weight[dst] = self.weight[src]
        self._last = None


def _logit(p: np.ndarray) -> np.ndarray:
    p = np.clip(p, 1e-3, 1 - 1e-3)
    return np.log(p / (1 - p))


def trials(offered: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """One step's (hits, tries), each (n, 2, max_k), from per-row positions offered, drafted and accepted."""
    position = np.arange(max_k)
    tries = np.stack([(offered[:, None] > position) & (drafted[:, None] >= position),
                      (drafted[:, None] > position) & (accepted[:, None] >= position)], axis=1)
    hits = np.stack([drafted[:, None] > position, accepted[:, None] > position], axis=1) & tries
    return hits.astype(float), tries.astype(float)
