"""How far a run-to-run spread lets a ratio be trusted.

A cell's repeats give each system a range of rates (min..max). A ratio of two systems then lies
between the worst and the best pairing of those ranges, and a goal on it is met only when the whole
range clears the bound, not met only when the whole range misses it, and inconclusive otherwise: on a
loaded machine a 10% spread makes a 3% margin meaningless, and saying "met" would be a guess. With a
single repeat the spread is unknown, so no goal is decided.
"""
from __future__ import annotations

import statistics

MET, NOT_MET, INCONCLUSIVE = "met", "not met", "inconclusive"


def rate_summary(rates: list[float]) -> dict[str, float | None]:
    """Median, min, max and relative spread ((max - min) / median; None for a single repeat)."""
    median = statistics.median(rates)
    spread = (max(rates) - min(rates)) / median if len(rates) > 1 and median else None
    return {"tokens_per_s": median, "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates), "spread": spread}


def rates(row: dict) -> tuple[float, float, float]:
    """A result row's tokens/s as (median, min, max)."""
    return row["tokens_per_s"], row["tokens_per_s_min"], row["tokens_per_s_max"]


def ratio_range(num: tuple[float, float, float], den: tuple[float, float, float]) -> tuple[float, float, float]:
    """(median ratio, lowest, highest) of num / den, each given as (median, min, max)."""
    return num[0] / den[0], num[1] / den[2], num[2] / den[1]


def verdict(low: float, high: float, op: str, bound: float, repeats: int) -> str:
    """met / not met / inconclusive for `ratio op bound` (op is ">=" or ">") given the ratio's range."""
    if repeats < 2:
        return INCONCLUSIVE
    clears = (lambda v: v >= bound) if op == ">=" else (lambda v: v > bound)
    if clears(low):
        return MET
    return NOT_MET if not clears(high) else INCONCLUSIVE
