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
The search runs only where some offers could beat the held ones (`headroom`: a bound a few array
operations cost), so a controller that holds k = 0 where drafting does not pay searches nothing.
"""
from __future__ import annotations

import numpy as np


def drain_weights(gain: np.ndarray, remaining: np.ndarray) -> np.ndarray:
    """(n,) worth of each row's tokens while the batch drains: its expected passes left at full speed
    (remaining tokens over 1 + its gain at every position) over the most any row has left."""
    passes = remaining / (1.0 + gain.sum(axis=1))
    return passes / max(float(passes.max()), 1e-9)


def headroom(gain: np.ndarray, reach: np.ndarray, base: float, column: np.ndarray, rate: float,
             weight: np.ndarray | None = None) -> tuple[float, float]:
    """An upper bound on how far any offers' weighted tokens - rate * time can rise above zero (Dinkelbach:
    offers beat `rate` only where it is positive), and a lower bound on the factor by which every gain would
    have to grow before an offer in which some row drafts could beat `rate` (below 1: one may already).

    Each column may go to any set of rows, and is worth at most the lesser of two bounds on what a set
    gains less rate * column[j] * the chance that one of its rows reaches j:
    - that chance is at least the set's largest reach: the best, over the rows' reaches as the largest, of
      the weighted gain of the rows reaching no further less rate * column[j] * that reach;
    - it is 1 - prod(1 - reach) >= 1 - exp(-R), R the set's summed reach, and the set gains at most R times
      the best gain per unit of reach: a convex function of R, so largest at the least or the most R a set
      of rows can have (one row: the first bound exactly; many: near a sure pass, as it is).
    The factor is the least, over columns, of the larger of the two bounds' cost over gain for the set that
    needs the least (under the second, (1 - exp(-R)) / R falls with R: all rows)."""
    weight = np.ones(gain.shape[0]) if weight is None else weight
    worth = weight[:, None] * gain
    order, columns = np.argsort(reach, axis=0), np.arange(reach.shape[1])
    gained, cost = np.cumsum(worth[order, columns], axis=0), rate * column * reach[order, columns]
    per_reach, least, most = (worth / np.maximum(reach, 1e-12)).max(0), reach.min(0), reach.sum(0)
    by_largest = (gained - cost).max(0)
    by_sum = np.maximum(*(per_reach * r + rate * column * np.expm1(-r) for r in (least, most)))
    best = np.minimum(by_largest, by_sum)
    need = np.maximum((cost / np.maximum(gained, 1e-12)).min(0),
                      -rate * column * np.expm1(-most) / np.maximum(per_reach * most, 1e-12))
    drafting = best[0] + np.maximum(best[1:], 0.0).sum()      # offers where some row drafts use column 1
    return float(weight.sum() - rate * base + max(drafting, 0.0)), float(need.min())


def pass_rates(offers: np.ndarray, gain: np.ndarray, reach: np.ndarray, base: float, column: np.ndarray,
               weight: np.ndarray | None = None) -> np.ndarray:
    """Predicted (weighted) tokens per second of offer vectors `offers` (..., n), for gain and reach (n, K),
    the time of a pass of width 1 `base`, the time `column` (K,) each further column adds and each row's
    worth `weight` (n,) (default 1)."""
    weight = np.ones(gain.shape[0]) if weight is None else weight
    return _rates(offers, weight[:, None] * gain, weight.sum(), reach, base, column)[0]


def _rates(offers: np.ndarray, worth: np.ndarray, rows: float, reach: np.ndarray, base: float,
           column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """pass_rates, given each position's weighted gain `worth` and the rows' summed weight; also the
    probability (..., n, K) that each row's draft does not reach each column, which the best responses reuse."""
    offered = np.arange(worth.shape[1]) < offers[..., None]
    miss = 1.0 - reach * offered
    tokens = rows + (worth * offered).sum(axis=(-2, -1))
    return tokens / (base + (1.0 - np.prod(miss, axis=-2)) @ column), miss


def _best_responses(miss: np.ndarray, gain: np.ndarray, reach: np.ndarray, column: np.ndarray,
                    rate: np.ndarray) -> np.ndarray:
    """Every row's offer maximising tokens - rate * time with the other rows' offers held: position j
    is worth its gain less its share of the pass's expected cost, which is nothing where another row
    surely reaches column j. miss (S, n, K): the held offers' (see _rates), rate (S,)."""
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
    worth, rows = weight[:, None] * gain, weight.sum()
    offers = np.repeat(np.arange(width + 1)[:, None], n, axis=1)                       # (S, n) uniform starts
    rates, miss = _rates(offers, worth, rows, reach, base, column)
    for _ in range(rounds if n > 1 else 0):   # one row's uniform starts are all its offers
        moved = _best_responses(miss, worth, reach, column, rates)
        moved_rates, moved_miss = _rates(moved, worth, rows, reach, base, column)
        better = moved_rates > rates * (1 + 1e-12)
        if not better.any():
            break
        offers, rates = np.where(better[:, None], moved, offers), np.where(better, moved_rates, rates)
        miss = np.where(better[:, None, None], moved_miss, miss)
    best = int(rates.argmax())
    return offers[best], float(rates[best])
