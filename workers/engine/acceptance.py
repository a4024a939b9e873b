"""Per-slot, per-position probabilities of what a draft does, learnt from counts and quick to follow a change.

Two events per draft position j (1-based), each a Bernoulli trial: the drafter REACHES j (it proposes
position j, given it was offered j and proposed j - 1: an n-gram may find no match, a confidence stop
may end the draft) and the target ACCEPTS j (given j was proposed and j - 1 accepted). Estimates are
decayed hits / tries over a prior worth `prior_tries` tries; a position's prior is the estimate of the
position before it (a copied span rarely gets worse as it goes on), so positions not tried yet are
judged by the last ones that were.

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
                 share: float = 0.05):
        self.decays = np.array(decays).reshape(-1, 1, 1, 1)
        self.prior_tries, self.share = np.array(prior_tries).reshape(-1, 1, 1), share
        self.hits = np.zeros((len(decays), max_rows, 2, max_k))
        self.tries = np.zeros_like(self.hits)
        self.weight = np.full((max_rows, len(decays)), 1.0 / len(decays))

    def scales(self, n: int, prior: np.ndarray) -> np.ndarray:
        """(scales, n, 2, max_k) estimates of the first n slots; `prior` (2,) is the prior at position 1."""
        hits, tries, m = self.hits[:, :n], self.tries[:, :n], self.prior_tries
        out = np.empty_like(hits)
        before = np.broadcast_to(prior, hits.shape[:-1])
        for j in range(hits.shape[-1]):
            out[..., j] = before = (hits[..., j] + m * before) / (tries[..., j] + m)
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
        self.hits[:, :n] = self.hits[:, :n] * self.decays + hits
        self.tries[:, :n] = self.tries[:, :n] * self.decays + tries

    def reset(self, start: int, count: int) -> None:
        self.hits[:, start : start + count] = 0.0
        self.tries[:, start : start + count] = 0.0
        self.weight[start : start + count] = 1.0 / self.weight.shape[1]

    def move(self, src: int, dst: int) -> None:
        self.hits[:, dst], self.tries[:, dst] = self.hits[:, src], self.tries[:, src]
        self.weight[dst] = self.weight[src]


def trials(offered: np.ndarray, drafted: np.ndarray, accepted: np.ndarray, max_k: int) -> tuple[np.ndarray, np.ndarray]:
    """One step's (hits, tries), each (n, 2, max_k), from per-row positions offered, drafted and accepted."""
    position = np.arange(max_k)
    tries = np.stack([(offered[:, None] > position) & (drafted[:, None] >= position),
                      (drafted[:, None] > position) & (accepted[:, None] >= position)], axis=1)
    hits = np.stack([drafted[:, None] > position, accepted[:, None] > position], axis=1) & tries
    return hits.astype(float), tries.astype(float)
