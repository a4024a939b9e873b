"""The bench's outputs: results.parquet (one row per cell and system, the run's metadata in the schema),
traces.parquet (every step of our systems' median runs), results.md (the tables, printed too) and plot.png."""
from __future__ import annotations

import datetime
import json
import os
import platform
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import torch

from jobs.bench.cells import exact
from jobs.bench.config import BenchConfig
from jobs.bench.fmt import num, percent
from jobs.bench.goals import PER_CELL, Goal, goal_rows
from jobs.bench.long_prefill import long_prefill_markdown
from jobs.bench.passes import passes_markdown
from jobs.bench.plot import plot
from jobs.bench.roofline import Floor
from jobs.bench.spread import rates, ratio_range
from jobs.bench.systems import PEER, SPECBATCH, adaptive_name, fixed_name
from jobs.bench.workloads import MIX
from workers.engine import native

_F, _I, _S = pa.float64(), pa.int64(), pa.string()
SCHEMA = pa.schema([
    ("section", _S), ("workload", _S), ("batch_size", _I), ("system", _S), ("family", _S), ("drafter", _S),
    ("k", _I), ("schedule", _S), ("rows", _I), ("repeats", _I),
    ("tokens_per_s", _F), ("tokens_per_s_min", _F), ("tokens_per_s_max", _F), ("spread", _F),
    ("ratio_vs_transformers", _F), ("ratio_vs_transformers_min", _F), ("ratio_vs_transformers_max", _F),
    ("generated_tokens", _I), ("wall_s", _F), ("target_passes", _I), ("row_passes", _I),
    ("tokens_per_pass", _F), ("tokens_per_row_pass", _F), ("accept_by_position", pa.list_(_F)), ("k_hist", pa.list_(_I)),
    ("bytes_per_pass", _F), ("floor_ms_per_pass", _F), ("ms_per_pass", _F), ("floor_fraction", _F),
    ("peak_mem_mb", _F), ("peak_delta_mb", _F), ("mem_method", _S),
    ("rows_checked", _I), ("rows_matching", _I), ("rows_as_k0", _I),
    ("ratio_vs_direct", _F), ("steady_tokens_per_s", _F), ("steady_ratio_vs_direct", _F), ("startup_s", _F),
    ("ratio_vs_peer", _F), ("ratio_vs_peer_min", _F), ("ratio_vs_peer_max", _F), ("best_peer", _S),
    ("rows_as_transformers", _I),
    ("controller_ms_per_step", _F), ("modelled_tokens_per_s", _F), ("oracle_tokens_per_s", _F),
])
COLUMNS = SCHEMA.names


def machine_info(cfg: BenchConfig, device: torch.device, command: str, quick: bool, floor: Floor) -> dict:
    import transformers

    return {
        "command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "cpu": f"{native.cpu_name()}, {native.vector_isa()}",
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": cfg.model.target, "draft": cfg.model.draft, "dtype": cfg.model.dtype, "split": cfg.split,
        "suite": cfg.suite, "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "quick": quick,
        "bandwidth_gb_s": floor.bandwidth / 1e9, "weight_mb": floor.weights / 1e6, "kv_kb_per_token": floor.kv_per_token / 1e3,
        "load_at_start": load_average(),
    }


def load_average() -> float | None:
    """The 1-minute load average: other work on a shared machine shows up here, and in the timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _mean_k(k_hist: list[int]) -> str:
    total = sum(k_hist)
    return "–" if not total else f"{sum(k * c for k, c in enumerate(k_hist)) / total:.1f}"


def _alphas(alpha: list[float], shown: int = 4) -> str:
    if not alpha:
        return "–"
    return " ".join(num(a, 2) for a in alpha[:shown]) + (" …" if len(alpha) > shown else "")


def _ratio(row: dict, over: str = "transformers") -> str:
    """The ratio, marked `?` when its range over the repeats holds 1.0: which system is faster is not known."""
    value, low, high = row.get(f"ratio_vs_{over}"), row.get(f"ratio_vs_{over}_min"), row.get(f"ratio_vs_{over}_max")
    unsure = value is not None and row["repeats"] > 1 and low < 1.0 < high
    return num(value, 2) + ("?" if unsure else "")


def _peer_ratio(row: dict) -> str:
    return "–" if row.get("ratio_vs_peer") is None else f"{_ratio(row, 'peer')} ({row['best_peer']})"


def _exact(row: dict) -> str:
    if exact(row):
        return "yes"
    if row["family"] == PEER:   # other kernels: a difference is expected, and counted rather than failed
        return f"differs (as transformers {row['rows_as_transformers']}/{row['rows']}, ref {row['rows_matching']}/{row['rows_checked']})"
    as_k0 = f", k=0 {row['rows_as_k0']}/{row['rows']}" if row.get("rows_as_k0") is not None else ""
    return f"NO (ref {row['rows_matching']}/{row['rows_checked']}{as_k0})"


def _peer_lines(gen: list[dict], notes: list[str]) -> list[str]:
    """What ran as a peer (or why not), then each system's tok/s and ours over the best peer at each batch size."""
    lines = ["Peers (`make bench-peers`; each in its own virtualenv, as a subprocess, model load untimed; same token "
             "ids, greedy, EOS set, max_new_tokens and thread count): " + ("; ".join(notes) or "none configured") + ".",
             "llama.cpp runs `Llama.generate` at batch 1 and, at larger batches, one `llama_decode` a step over every "
             "live row (a KV stream per row); it and vLLM-CPU (max_num_seqs) keep `batch` rows live. Peer rows count their rows equal to transformers' "
             "output in the same cell (other kernels may differ); memory is not measured for them. × best peer: "
             "ours over the faster plain peer (k = 0 rows) or over the peers' prompt lookup (speculation rows, batch 1; "
             "at larger batches, the faster plain peer)."]
    if not any(r["family"] == PEER for r in gen):
        return lines
    workloads = list(dict.fromkeys(r["workload"] for r in gen))
    workload = MIX if MIX in workloads else workloads[0]
    rows = [r for r in gen if r["workload"] == workload]
    batches = list(dict.fromkeys(r["batch_size"] for r in rows))
    cell = {(r["system"], r["batch_size"]): r for r in rows}
    lines += ["", f"Against the peers ({workload}): tok/s, and ours over the best peer, at each batch size.", "",
              "| system | " + " | ".join(f"b={b} tok/s | b={b} × best peer" for b in batches) + " |",
              "|---|" + "---:|---|" * len(batches)]
    for system in dict.fromkeys(r["system"] for r in rows):
        cells = [cell.get((system, b)) for b in batches]
        lines.append(f"| {system} | " + " | ".join(f"{num(c['tokens_per_s'])} | {_peer_ratio(c)}" if c else "– | –"
                                                   for c in cells) + " |")
    return lines


def _controller_lines(gen: list[dict], cfg: BenchConfig) -> list[str]:
    """Per cell and drafter: adaptive against the best fixed k (measured) and against the trace oracle (modelled)."""
    cell = {(r["workload"], r["batch_size"], r["system"]): r for r in gen}
    rows = []
    for drafter in cfg.drafters:
        for w, b in dict.fromkeys((r["workload"], r["batch_size"]) for r in gen):
            adaptive = cell.get((w, b, adaptive_name(drafter)))
            fixed = [cell[key] for key in ((w, b, fixed_name(drafter, k)) for k in sorted(set(cfg.ks))) if key in cell]
            if not adaptive or not fixed:
                continue
            best = max(fixed, key=lambda r: r["tokens_per_s"])
            value, low, high = ratio_range(rates(adaptive), rates(best))
            unsure = "?" if adaptive["repeats"] > 1 and low < 1.0 < high else ""
            oracle, modelled = adaptive.get("oracle_tokens_per_s"), adaptive.get("modelled_tokens_per_s")
            over = [num(r.get("modelled_tokens_per_s") / oracle, 2) if oracle else "–" for r in (adaptive, best)]
            best_modelled = max((r.get("modelled_tokens_per_s") or 0.0 for r in fixed), default=0.0)
            steady = num(modelled / best_modelled, 2) if modelled and best_modelled else "–"
            rows.append(f"| {w} | {b} | {drafter} | k={best['k']} | {num(value, 2)}{unsure} | {steady} | {over[0]} | "
                        f"{over[1]} | {num(adaptive.get('controller_ms_per_step'), 3)} |")
    if not rows:
        return []
    return [("Controller (issue 23): adaptive over the best fixed k of its drafter (k=0 included), measured tok/s "
             "(`?`: the range over the repeats holds 1.0); modelled: the same in tokens per second of the cost model "
             "fitted on the cell's traces (every run's passes priced alike: verify seconds by rows × width, draft "
             "seconds per column; plus each run's own controller seconds), which the machine's speed drifting "
             "between runs does not move; and each over the trace oracle: the best width per step in hindsight on "
             "the widest fixed k's steps, in the same model (jobs/bench/oracle.py)."), "",
            ("| workload | batch | drafter | best fixed | adaptive ÷ best fixed | modelled | adaptive ÷ oracle | "
             "best fixed ÷ oracle | adaptive controller ms/step |"),
            "|---|---:|---|---|---:|---:|---:|---:|---:|"] + rows


_MARK = {"met": "✓", "not met": "✗", "inconclusive": "?", None: ""}


def _goal_text(g: Goal) -> str:
    if g.value is None:
        return "–"
    return f"{num(g.value, 2)} ({num(g.low, 2)}–{num(g.high, 2)}) {_MARK[g.verdict]}"


def _goal_tables(goals: list[Goal]) -> list[str]:
    """Per-cell goals as a matrix (workload x batch/check), the others as a list; verdict counts first."""
    counts = {v: sum(g.verdict == v for g in goals) for v in ("met", "not met", "inconclusive")}
    lines = ["Goals (issues 12 and 13): " + ", ".join(f"{n} {v}" for v, n in counts.items())
             + "; value (range over the repeats); ✓ met, ✗ not met, ? inconclusive: the range straddles the bound "
               "(or one repeat: spread unknown).", ""]
    per_cell = [g for g in goals if g.cell]
    if per_cell:
        columns = list(dict.fromkeys((b, c) for _, b, c in (g.cell for g in per_cell)))
        lines += [f"Per cell: {PER_CELL}.", "",
                  "| workload | " + " | ".join(f"b={b} {c}" for b, c in columns) + " |",
                  "|---|" + "---|" * len(columns)]
        by_cell = {g.cell: g for g in per_cell}
        for w in dict.fromkeys(g.cell[0] for g in per_cell):
            lines.append(f"| {w} | " + " | ".join(_goal_text(by_cell[(w, b, c)]) if (w, b, c) in by_cell else "–"
                                                  for b, c in columns) + " |")
        lines.append("")
    lines += ["| issue | check | value (range) | goal |", "|---|---|---|---|"]
    lines += [f"| {g.issue} | {g.check} | {_goal_text(g)} | {g.target} |" for g in goals if not g.cell]
    return lines


def markdown(results: list[dict], meta: dict, cfg: BenchConfig, took_s: float) -> str:
    """The results as Markdown: a header naming command, date, machine and prompts, then the tables."""
    gen = [r for r in results if r["section"] == "generation"]
    with_peers = any(r["family"] == PEER for r in gen)
    half = ("the suite's report half: nothing is tuned on it" if meta["split"] == "report"
            else "the suite's tune half: constants may be fitted on it (the README's tables come from the report half)")
    lines = [
        "## specbatch bench" + (" (--quick)" if meta["quick"] else ""),
        "",
        (f"`{meta['command']}` on {meta['date']}; took {took_s:.0f} s; 1-minute load average "
         f"{num(meta['load_at_start'], 2)} at the start, {num(meta.get('load_at_end'), 2)} at the end."),
        (f"Machine: {meta['platform']} ({meta['machine']}; {meta.get('cpu', 'CPU not recorded')}), {meta['cpu_count']} CPUs, device {meta['device']}, "
         f"torch {meta['torch']} ({meta['threads']} threads for every system), transformers {meta['transformers']}."),
        f"Prompts: {half} ({meta['suite']}).",
        f"Model {meta['model']} ({meta['dtype']})" + (f", draft {meta['draft']}" if meta["draft"] else "")
        + f"; greedy, max_new_tokens {meta['max_new_tokens']}; tok/s is the median of {meta['repeats']} "
          "repeat(s), interleaved across systems (min–max; spread = (max − min) / median); × is over transformers "
          "`generate` at the same batch size and workload (`?`: its range over the repeats holds 1.0); "
          "tok/row-pass = generated / (rows summed over target passes); α = acceptance by draft position; "
          "controller ms/step = time in the adaptive or fixed controller per target pass; "
          "exact = every row with a reference equals transformers' greedy output at batch 1, and every row of "
          "ours equals our k=0 output.",
        (f"Roofline: memory bandwidth {num(meta['bandwidth_gb_s'])} GB/s (best read-only pass over a large tensor); "
         f"a target pass reads {num(meta['weight_mb'])} MB of weights plus {num(meta['kv_kb_per_token'])} kB of KV "
         "cache per cached token of each live row (MB/pass); floor = those bytes / bandwidth; % floor = floor time "
         "per pass / measured time per pass (drafting and prefill included)."),
        f"Peak memory: {gen[0]['mem_method'] if gen else '–'}, all model copies included; (+cell) is the cell's own "
        "working set over what was in use when it started.",
        "",
        "| workload | batch | system | tok/s (min–max) | spread | × |" + (" × best peer |" if with_peers else "")
        + " tok/row-pass | α1..α4 | mean k | controller ms/step | MB/pass | ms/pass | floor ms | % floor | peak MB (+cell) | exact |",
        "|---|---:|---|---|---:|---:|" + ("---|" if with_peers else "") + "---:|---|---:|---:|---:|---:|---:|---:|---:|---|",
    ]
    for r in gen:
        lines.append(
            f"| {r['workload']} | {r['batch_size']} | {r['system']} | {num(r['tokens_per_s'])} "
            f"({num(r['tokens_per_s_min'])}–{num(r['tokens_per_s_max'])}) | {percent(r['spread'])} | {_ratio(r)} | "
            + (f"{_peer_ratio(r)} | " if with_peers else "") +
            f"{num(r['tokens_per_row_pass'], 2)} | {_alphas(r['accept_by_position'])} | "
            f"{_mean_k(r['k_hist']) if r['family'] == SPECBATCH else '–'} | {num(r.get('controller_ms_per_step'), 3)} | "
            f"{num(r['bytes_per_pass'] and r['bytes_per_pass'] / 1e6, 0)} | "
            f"{num(r['ms_per_pass'])} | {num(r['floor_ms_per_pass'])} | {percent(r['floor_fraction'])} | "
            f"{num(r['peak_mem_mb'], 0)} (+{num(r['peak_delta_mb'], 0)}) | {_exact(r)} |")
    controller = _controller_lines(gen, cfg)
    if controller:
        lines += [""] + controller
    if meta.get("peers") or with_peers:
        lines += [""] + _peer_lines(gen, meta.get("peers") or [])
    if meta.get("skipped"):
        lines += ["", f"Not run (the {meta['split']} split has too few prompts to fill them): {', '.join(meta['skipped'])}."]
    pipe = [r for r in results if r["section"] == "pipeline"]
    if meta.get("pipeline_error"):
        lines += ["", f"Pipeline row FAILED: {meta['pipeline_error']}"]
    if pipe:
        lines += ["", ("Pipeline: the same rows as a whole job (Ray, planning, reading, writing, actor start and "
                       "model load included) against ShardRunner alone with the models already loaded "
                       "(goal: ratio >= 0.9)."), "",
                  "| workload | rows | batch | system | tok/s end to end | wall s | tok/s inside shards | outside shards s "
                  "| ratio | rows equal to a reference |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        lines += [f"| {r['workload']} | {r['rows']} | {r['batch_size']} | {r['system']} | {num(r['tokens_per_s'])} | "
                  f"{num(r['wall_s'])} | {num(r.get('steady_tokens_per_s'))} | {num(r.get('startup_s'))} | "
                  f"{num(r.get('ratio_vs_direct'), 2)} | {r['rows_matching']}/{r['rows_checked']} |" for r in pipe]
    if meta.get("passes"):
        lines += [""] + passes_markdown(meta["passes"])
    if meta.get("long_prefill"):
        lines += [""] + long_prefill_markdown(meta["long_prefill"])
    goals = goal_rows(results, cfg)
    if goals:
        lines += [""] + _goal_tables(goals)
    return "\n".join(lines) + "\n"


def trace_rows(results: list[dict]) -> list[dict]:
    """One row per step of each of our systems' median run in each cell: what the oracle was computed from."""
    return [{"workload": r["workload"], "batch_size": r["batch_size"], "system": r["system"], "step": i,
             "offered": s.offered.tolist(), "drafted": s.drafted.tolist(), "accepted": s.accepted.tolist(),
             "width": s.width, "draft_s": s.draft_s, "verify_s": s.verify_s}
            for r in results if r.get("trace") for i, s in enumerate(r["trace"])]


def write_outputs(results: list[dict], meta: dict, cfg: BenchConfig, took_s: float, out: Path) -> str:
    """results.parquet, traces.parquet, results.md and plot.png in `out`; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in results], schema=SCHEMA)
    meta_json = json.dumps({**meta, "took_s": round(took_s, 1)})
    pq.write_table(table.replace_schema_metadata({"specbatch_bench": meta_json}), out / "results.parquet")
    pq.write_table(pa.Table.from_pylist(trace_rows(results)), out / "traces.parquet")
    text = markdown(results, meta, cfg, took_s)
    (out / "results.md").write_text(text)
    plot(results, cfg, out / "plot.png")
    return text
