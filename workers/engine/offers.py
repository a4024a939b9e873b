"""Per-row draft lengths for one verify pass: the offers with the most generated tokens per second.

A verify pass feeds every row its last token plus as many columns as the longest draft, so its cost
depends on the pass's width, not on each row's length. What a row's offer changes is how likely it is
to be the row that widens the pass: a row offered k_r positions reaches position j with probability
reach[r, j] (an n-gram finds no match, a confidence stop ends the draft), and the pass reaches
column j unless no row does. With rows independent,

    tokens(k) = n + sum_r sum_{j <= k_r} gain[r, j]        (gain: probability position j is accepted)
    time(k)   = base + sum_j column[j] * (1 - prod_{r: k_r >= j} (1 - reach[r, j]))

and the offers maximise tokens / time. A row that copies (high gain, reach ~ 1) keeps the pass wide;
then its neighbours' positions cost nothing and are offered too, while a row whose drafts widen the
pass for little gain is held short. When every reach is 1 (a draft model) the best offers are uniform.

When no prompt waits for a slot the batch only drains, and it ends with its slowest row: a row due to
finish long before that speeds up nothing but its own exit, so its tokens are weighted by its expected
passes left over the slowest row's (`drain_weights`); a copying row then drafts only where the pass it
widens pays for its neighbours, which are the ones holding the batch.

Search: from every uniform offer (one k for the batch: so never worse than the best single k), rounds
of best responses (Dinkelbach's parametric form of the ratio at the start's own rate), keeping a
round only where it raises the rate. Exact on every small case tried against brute force (tests).
"""
from __future__ import annotations

import numpy as np


def drain_weights(gain: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """(n,) worth of each row's tokens while the batch drains: its expected passes left at full speed
    (remaining tokens over 1 + its gain at every position) over the most any row has left."""
    passes = remaining / (1.0 + gain.sum(axis=1))
    return passes / max(float(passes.max()), 1e-9)


def pass_rates(offers: np.ndarray, gain: np.ndarray, reach: np.ndarray, base: float, column: np.ndarray,
               weight: np.ndarray | None = None) -> np.ndarray:
    """Predicted (weighted) tokens per second of offer vectors `offers` (..., n), for gain and reach (n, K),
    the time of a pass of width 1 `base`, the time `column` (K,) each further column adds and each row's
    worth `weight` (n,) (default 1)."""
    weight = np.ones(gain.shape[0]) if weight is None else weight
    offered = np.arange(gain.shape[1]) < offers[..., None]
    tokens = weight.sum() + (weight[:, None] * gain * offered).sum(axis=(-2, -1))
    reached = 1.0 - np.prod(1.0 - reach * offered, axis=-2)
    return tokens / (base + reached @ column)


def _best_responses(offers: np.ndarray, gain: np.ndarray, reach: np.ndarray, column: np.ndarray,
                    rate: np.ndarray) -> np.ndarray:
    """Every row's offer maximising tokens - rate * time with the other rows' offers held: position j
    is worth its gain less its share of the pass's expected cost, which is nothing where another row
    surely reaches column j. offers (S, n), rate (S,)."""
    miss = 1.0 - reach * (np.arange(gain.shape[1]) < offers[..., None])               # (S, n, K)
    ones = np.ones_like(miss[:, :1])
    before = np.cumprod(np.concatenate([ones, miss[:, :-1]], axis=1), axis=1)
    after = np.cumprod(np.concatenate([ones, miss[:, :0:-1]], axis=1), axis=1)[:, ::-1]
    worth = gain - rate[:, None, None] * column * reach * before * after              # leave-one-out products
    value = np.concatenate([np.zeros_like(worth[..., :1]), np.cumsum(worth, axis=-1)], axis=-1)
    return value.argmax(axis=-1)


def best_offers(gain: np.ndarray, reach: np.ndarray, base: float, column: np.ndarray,
                weight: np.ndarray | None = None, rounds: int = 3) -> tuple[np.ndarray, float]:
    """The offers (n,) with the highest predicted rate, and that rate."""
    n, width = gain.shape
    weight = np.ones(n) if weight is None else weight
    offers = np.repeat(np.arange(width + 1)[:, None], n, axis=1)                       # (S, n) uniform starts
    rates = pass_rates(offers, gain, reach, base, column, weight)
    for _ in range(rounds):
        moved = _best_responses(offers, weight[:, None] * gain, reach, column, rates)
        moved_rates = pass_rates(moved, gain, reach, base, column, weight)
        better = moved_rates > rates * (1 + 1e-12)
        if not better.any():
            break
        offers, rates = np.where(better[:, None], moved, offers), np.where(better, moved_rates, rates)
    best = int(rates.argmax())
    return offers[best], float(rates[best])
