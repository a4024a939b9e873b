"""Cells: every (batch size, workload) runs every system `repeats` times, interleaved.

Repeats are interleaved repeat-major: round r runs every system of the cell once (in an order rotated by
r) before round r + 1 starts, so a burst of load on a shared machine hits every system of a cell alike
instead of one system's repeats, and the spread over the rounds shows how much load there was. Each
(system, batch size) warms up once, untimed, before its first cell: first-call costs stay out.

Speed only counts when the output is right: every row with a reference must equal transformers'
greedy output at batch 1, and every row of this generator must equal its own k = 0 output in the same
cell (speculation is lossless), which covers the rows without a reference. Peers (peers.py) decode with
other kernels: their rows are counted against transformers' output in the same cell, not required to match.
"""
from __future__ import annotations

from collections.abc import Callable

from jobs.bench.baselines import run_transformers
from jobs.bench.config import BenchConfig
from jobs.bench.fmt import percent
from jobs.bench.memory import PeakMemory
from jobs.bench.models import BenchModels
from jobs.bench.oracle import fit_costs, oracle_rate, run_rate
from jobs.bench.peers import PeerError, PeerPool, add_peer_ratios
from jobs.bench.roofline import Floor
from jobs.bench.spread import rate_summary, ratio_range, rates
from jobs.bench.systems import K0, PEER, SPECBATCH, TRANSFORMERS, Run, System, bench_systems, fixed_name, run_specbatch
from jobs.bench.workloads import Prompt, cell_rows

References = dict[tuple[int, ...], list[int]]


def run_system(system: System, models: BenchModels, prompts: list[Prompt], batch_size: int, max_new_tokens: int,
               cfg: BenchConfig, peers: PeerPool | None = None) -> Run:
    if system.family == PEER:
        return peers.run(system, prompts, batch_size, max_new_tokens)
    runner = run_transformers if system.family == TRANSFORMERS else run_specbatch
    return runner(system, models, prompts, batch_size, max_new_tokens, cfg)


def schedule(systems: list[System], repeats: int) -> list[tuple[int, System]]:
    """(round, system) in run order: repeat-major, each round's order rotated by one."""
    order = []
    for round_ in range(repeats):
        shift = round_ % len(systems)
        order += [(round_, s) for s in systems[shift:] + systems[:shift]]
    return order


def _rows_equal(outputs: list[list[int]], expected: list[list[int] | None]) -> int:
    return sum(o == e for o, e in zip(outputs, expected) if e is not None)


def _rate(run: Run) -> float:
    return run.generated / run.wall_s if run.wall_s else 0.0


def median_run(runs: list[Run]) -> Run:
    """The repeat with the median tokens/s: the one whose counters and trace stand for the cell."""
    return sorted(runs, key=_rate)[len(runs) // 2]


def summarize_cell(system: System, runs: list[Run], peaks: list[tuple[float, float]], prompts: list[Prompt],
                   references: References, k0_outputs: list[list[int]] | None, floor: Floor) -> dict:
    """One result row from a cell's repeats: median tokens/s with its range; counters from the median run."""
    run, expected = median_run(runs), [references.get(p.ids) for p in prompts]
    return {
        "section": "generation", "system": system.name, "family": system.family, "drafter": system.drafter,
        "k": system.k, "schedule": system.schedule, "rows": len(prompts), "repeats": len(runs),
        **rate_summary([_rate(r) for r in runs]),
        "generated_tokens": run.generated, "wall_s": run.wall_s, "target_passes": run.target_passes,
        "row_passes": run.row_passes,
        "tokens_per_pass": run.generated / run.target_passes if run.target_passes else None,
        "tokens_per_row_pass": run.generated / run.row_passes if run.row_passes else None,
        "accept_by_position": run.accept_by_position, "k_hist": run.k_hist,
        "controller_ms_per_step": None if run.controller_s is None
        else 1e3 * run.controller_s / max(run.target_passes, 1),
        "trace": run.steps,   # not a results.parquet column: traces.parquet (report.write_outputs)
        **floor.per_pass(run.target_passes, run.kv_reads, run.wall_s),
        "peak_mem_mb": max(p for p, _ in peaks), "peak_delta_mb": max(d for _, d in peaks),
        "rows_checked": sum(e is not None for e in expected),
        "rows_matching": min(_rows_equal(r.outputs, expected) for r in runs),
        "rows_as_k0": None if k0_outputs is None else min(_rows_equal(r.outputs, k0_outputs) for r in runs),
    }


def exact(row: dict) -> bool:
    """Every checked row equals the reference, and every row equals k = 0's (ours) or transformers' (a peer's)."""
    ours_ok = row["family"] == TRANSFORMERS or row["rows_as_k0"] in (None, row["rows"])
    peer_ok = row.get("rows_as_transformers") in (None, row["rows"])
    return row["rows_matching"] == row["rows_checked"] and ours_ok and peer_ok


def _warm_up(systems: list[System], models: BenchModels, prompts: list[Prompt], batch_size: int, cfg: BenchConfig,
             peers: PeerPool | None) -> list[System]:
    """Each system once, untimed (a peer starts its engine here); the systems left after peers that failed."""
    kept = []
    for system in systems:
        try:
            run_system(system, models, prompts, batch_size, cfg.warmup_tokens, cfg, peers)
        except PeerError as exc:
            peers.fail(system, exc)
            continue
        kept.append(system)
    return [s for s in kept if s.family != PEER or s.peer not in peers.dead]


def run_cells(cfg: BenchConfig, models: BenchModels, workloads: dict[str, list[Prompt]], references: References,
              floor: Floor, log: Callable[[str], None], peers: PeerPool | None = None) -> list[dict]:
    memory, results = PeakMemory(models.device), []
    first = next(iter(workloads.values()))
    for batch_size in cfg.batch_sizes:
        systems = bench_systems(cfg, batch_size, peers.systems(batch_size) if peers else ())
        systems = _warm_up(systems, models, first[:batch_size], batch_size, cfg, peers)
        for workload, all_prompts in workloads.items():
            prompts = cell_rows(all_prompts, cfg, batch_size)
            if prompts is None:
                continue
            runs: dict[str, list[Run]] = {s.name: [] for s in systems}
            peaks: dict[str, list[tuple[float, float]]] = {s.name: [] for s in systems}
            for _, system in schedule(systems, cfg.repeats):
                if system.family == PEER and system.peer in peers.dead:
                    continue
                memory.reset()
                try:
                    runs[system.name].append(run_system(system, models, prompts, batch_size, cfg.max_new_tokens, cfg,
                                                        peers))
                except PeerError as exc:
                    peers.fail(system, exc)
                    continue
                peaks[system.name].append((memory.peak_mb(), memory.delta_mb()))
            systems = [s for s in systems if s.family != PEER or s.peer not in peers.dead]
            k0 = runs[K0][0].outputs if K0 in runs else None
            as_transformers = runs[TRANSFORMERS][0].outputs
            modelled = oracle_fields(systems, runs, cfg)
            for system in systems:
                row = summarize_cell(system, runs[system.name], peaks[system.name], prompts, references,
                                     k0 if system.family == SPECBATCH else None, floor)
                row.update(modelled.get(system.name, {}))
                if system.family == PEER:   # its memory is its own process's, not measured here
                    row.update(rows_as_transformers=min(_rows_equal(r.outputs, as_transformers) for r in runs[system.name]),
                               peak_mem_mb=None, peak_delta_mb=None)
                results.append({"workload": workload, "batch_size": batch_size, "mem_method": memory.method, **row})
                log(f"  b={batch_size:<3} {workload:<18} {system.name:<30} {row['tokens_per_s']:7.1f} tok/s "
                    f"(spread {percent(row['spread'])})  {percent(row['floor_fraction'])} of floor  "
                    f"exact={exact(row)}")
    add_ratios(results)
    add_peer_ratios(results)
    return results


def oracle_fields(systems: list[System], runs: dict[str, list[Run]], cfg: BenchConfig) -> dict[str, dict]:
    """Per system of this generator, its median run's steps in tokens per second of the cell's cost model, and
    for a drafter's systems the trace oracle's on that drafter's widest fixed k (jobs/bench/oracle.py)."""
    ours = [s for s in systems if s.family == SPECBATCH and runs[s.name]]
    costs = fit_costs([r.steps for s in ours for r in runs[s.name]])
    medians = {s.name: median_run(runs[s.name]) for s in ours}
    out = {name: {"modelled_tokens_per_s": run_rate(run.steps, costs, run.controller_s or 0.0)}
           for name, run in medians.items()}
    widest = max(cfg.ks, default=0)
    for drafter in cfg.drafters:
        reference = runs.get(fixed_name(drafter, widest)) if widest else None
        if reference:
            oracle = oracle_rate(median_run(reference).steps, costs, cfg.max_k)
            for s in ours:
                if s.drafter == drafter:
                    out[s.name]["oracle_tokens_per_s"] = oracle
    return out


def add_ratios(results: list[dict]) -> None:
    """tokens/s over transformers' plain `generate` at the same batch size and workload, with its range."""
    base = {(r["workload"], r["batch_size"]): r for r in results if r["system"] == TRANSFORMERS}
    for r in results:
        b = base.get((r["workload"], r["batch_size"]))
        value, low, high = (1.0, 1.0, 1.0) if b is r else ratio_range(rates(r), rates(b)) if b else (None, None, None)
        r.update(ratio_vs_transformers=value, ratio_vs_transformers_min=low, ratio_vs_transformers_max=high)
