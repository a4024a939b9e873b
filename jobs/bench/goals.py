"""The speed goals of issues 12 and 13, checked against this run's cells.

Each goal is a ratio against a bound; its verdict (met / not met / inconclusive) comes from the ratio's
range over the cell's repeats (spread.verdict), never from the median alone.
"""
from __future__ import annotations

from dataclasses import dataclass

from jobs.bench.config import BenchConfig
from jobs.bench.spread import rates, ratio_range, verdict
from jobs.bench.systems import K0, TRANSFORMERS, adaptive_name, fixed_name, lookup_name
from jobs.bench.workloads import MIX


VS_BEST, VS_BEST_MIX, VS_K0 = ">= 0.97", ">= 1.02", ">= 0.97"
PER_CELL = (f"adaptive / best fixed k {VS_BEST} in every category cell and {VS_BEST_MIX} on the mix; "
            f"adaptive / k=0 {VS_K0} everywhere")


@dataclass(frozen=True)
class Goal:
    issue: str
    check: str
    value: float | None
    low: float | None
    high: float | None
    target: str           # "op bound", e.g. ">= 0.97"
    verdict: str | None   # None: a system or cell the goal needs did not run
    cell: tuple[str, int, str] | None = None   # (workload, batch size, column) of a per-cell goal



def _goal(issue: str, check: str, span: tuple[float, float, float] | None, target: str, repeats: int,
          cell: tuple[str, int, str] | None = None) -> Goal:
    if span is None:
        return Goal(issue, check, None, None, None, target, None, cell)
    op, bound = target.split()
    return Goal(issue, check, *span, target, verdict(span[1], span[2], op, float(bound), repeats), cell)


def _best(rows: list[dict]) -> tuple[float, float, float] | None:
    """The fastest of several systems as (median, min, max): its median, and the range the fastest can have."""
    if not rows:
        return None
    return max(r["tokens_per_s"] for r in rows), max(r["tokens_per_s_min"] for r in rows), max(r["tokens_per_s_max"] for r in rows)


def goal_rows(results: list[dict], cfg: BenchConfig) -> list[Goal]:
    cell = {(r["workload"], r["batch_size"], r["system"]): r for r in results if r["section"] == "generation"}
    workloads = list(dict.fromkeys(w for w, _, _ in cell))
    repeats = cfg.repeats

    def ratio(w: str, b: int, num: str, den: str) -> tuple[float, float, float] | None:
        a, d = cell.get((w, b, num)), cell.get((w, b, den))
        return ratio_range(rates(a), rates(d)) if a and d else None

    out = []
    for drafter in cfg.drafters:
        adaptive = adaptive_name(drafter)
        fixed = [fixed_name(drafter, k) for k in sorted(set(cfg.ks))]
        for w in workloads:
            for b in cfg.batch_sizes:
                a, best = cell.get((w, b, adaptive)), _best([cell[(w, b, f)] for f in fixed if (w, b, f) in cell])
                span = ratio_range(rates(a), best) if a and best else None
                out.append(_goal("13", f"{w} b={b}: {drafter} adaptive / best fixed k", span,
                                 VS_BEST_MIX if w == MIX else VS_BEST, repeats, (w, b, f"{drafter} adaptive / best fixed k")))
                out.append(_goal("13", f"{w} b={b}: {drafter} adaptive / k=0", ratio(w, b, adaptive, K0), VS_K0,
                                 repeats, (w, b, f"{drafter} adaptive / k=0")))
        out.append(_goal("13", f"rewriting b=1: {drafter} adaptive / transformers prompt lookup",
                         ratio("rewriting", 1, adaptive, lookup_name(cfg)), ">= 1.15", repeats))
        out.append(_goal("13", f"rewriting b=16: {drafter} adaptive / k=0", ratio("rewriting", 16, adaptive, K0),
                         ">= 1.5", repeats))
    floor_workload = MIX if MIX in workloads else workloads[0] if workloads else MIX
    k0 = cell.get((floor_workload, 1, K0))
    fraction = k0 and k0["floor_fraction"]
    span = (fraction, fraction * k0["tokens_per_s_min"] / k0["tokens_per_s"],
            fraction * k0["tokens_per_s_max"] / k0["tokens_per_s"]) if fraction else None
    out.append(_goal("12", f"{floor_workload} b=1: k=0 fraction of the bandwidth floor", span, ">= 0.6", repeats))
    for b in (b for b in cfg.batch_sizes if b >= 8):
        out.append(_goal("12", f"{floor_workload} b={b}: k=0 / transformers generate",
                         ratio(floor_workload, b, K0, TRANSFORMERS), ">= 1.5", repeats))
    return out
