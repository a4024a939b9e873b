"""OUTPUT/report.html: one self-contained page (inline CSS and SVG, no script, no network) about a job.

Built only from what the output folder holds (_job.json, the lease, stats parts, retries, errors, the
machine's load in summary.json, a few rows of the first data files), so `specbatch report OUTPUT` can
rebuild it for a finished job, a stopped one or one still running.
"""
from __future__ import annotations

import datetime
import json
from collections import defaultdict
from html import escape

import pyarrow.parquet as pq
import yaml

from pipeline.job_state import committed_shards, job_status, read_manifest
from pipeline.noise import SPREAD_LIMIT, MachineLoad, load_of, load_text, ms_per_pass, spread, verdict
from pipeline.samples import clip, read_samples
from pipeline.summary import busy_seconds, failed_rows
from pipeline.svg import bar_chart, line_chart
from workers.schemas import Counters, ShardStats
from workers.storage import Store

SHOWN_ROWS = 50  # rows of the longer tables (slowest shards, failed rows, retries)
SAMPLES_PER_GROUP, SAMPLE_GROUPS = 3, 10  # sample completions: per category (or task), and categories shown

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 24px auto; max-width: 1000px; color: #222; padding: 0 16px; }
h1 { font-size: 22px; margin-bottom: 4px; } h2 { font-size: 17px; margin-top: 32px; border-bottom: 1px solid #ddd; }
.status { display: inline-block; padding: 1px 8px; border-radius: 10px; font-size: 13px; color: #fff; }
.finished { background: #2ca02c; } .running { background: #1f77b4; } .incomplete { background: #d62728; }
.figures { display: flex; flex-wrap: wrap; gap: 10px; margin: 12px 0; }
.figure { border: 1px solid #ddd; border-radius: 6px; padding: 6px 12px; min-width: 110px; }
.figure b { display: block; font-size: 18px; } .figure span { color: #666; font-size: 12px; }
table { border-collapse: collapse; margin: 8px 0; font-size: 13px; } td, th { border: 1px solid #ddd; padding: 3px 8px; }
th { background: #f5f5f5; text-align: left; } td.n { text-align: right; font-variant-numeric: tabular-nums; }
pre { background: #f7f7f7; padding: 10px; overflow-x: auto; font-size: 12px; }
svg.chart { display: block; margin: 8px 0; max-width: 100%; height: auto; }
svg.chart text { font: 11px system-ui, sans-serif; fill: #333; }
svg.chart .axis { stroke: #333; } svg.chart .grid { stroke: #eee; }
.note { color: #666; font-size: 13px; }
.warn { background: #fff4e5; border-left: 4px solid #f0a020; padding: 6px 10px; }
td.text { white-space: pre-wrap; max-width: 420px; vertical-align: top; }
"""


PLAN_FILE = "plan.json"   # written by `specbatch plan` into the output it plans for


def write_report(store: Store, stats: list[ShardStats] | None = None) -> str:
    """Build the report (from `stats`, or from the committed shards' parts) and write it; return its URL."""
    store.write(build_report(store, stats).encode(), "report.html")
    return store.url("report.html")


def build_report(store: Store, stats: list[ShardStats] | None = None) -> str:
    manifest = read_manifest(store)
    stats = sorted(committed_shards(store).values() if stats is None else stats, key=lambda s: s.shard_id)
    retries = sorted((json.loads(store.read("stats", "retries", url.rsplit("/", 1)[-1]))
                      for url in store.list("stats", "retries", suffixes=[".json"])), key=lambda r: r["at"])
    failed = (store.apply(lambda fs, path: pq.read_table(path, filesystem=fs), "read", "errors.parquet")
              if store.exists("errors.parquet") else failed_rows(store, stats)).to_pylist()
    status = job_status(store)
    summary = store.read_json("summary.json") or {}
    load = load_of(summary.get("noise"))
    found = spread(ms_per_pass(stats))
    warning = f'<p class="warn">{escape(verdict(found, load))}.</p>' if found and found.noisy else ""
    body = [_header(manifest, stats, status, store.root, warning), _throughput(stats, load, warning),
            _plan(store, stats), _drafters(summary.get("learning"), stats), _speculation(manifest, stats),
            _rows(stats, failed), _samples(store), _runs(manifest, stats, retries), _workers(stats), _setup(manifest)]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(manifest["name"])} – '
            f'specbatch report</title><style>{CSS}</style></head><body>{"".join(body)}'
            f'<p class="note">Written {_when(datetime.datetime.now().timestamp())} by specbatch report.</p></body></html>')


def generating_s(s: ShardStats) -> float:
    """The generator's time on a shard (prefill, draft, verify, the controller and the rest), without reading and
    writing."""
    return s.prefill_s + s.verify_s + s.draft_s + s.controller_s + s.other_s


def _when(epoch: float | None) -> str:
    return datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S") if epoch else "–"


def _table(header: list[str], rows: list[list], numeric: set[int] = frozenset(), text: set[int] = frozenset()) -> str:
    """A table of escaped cells; `numeric` columns align right, `text` columns keep their line breaks."""
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    classes = {**{i: ' class="n"' for i in numeric}, **{i: ' class="text"' for i in text}}
    body = "".join("<tr>" + "".join(f"<td{classes.get(i, '')}>{_cell(v)}</td>" for i, v in enumerate(row)) + "</tr>"
                   for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _cell(value) -> str:
    if isinstance(value, float):
        return f"{value:,.2f}"
    if isinstance(value, int):
        return f"{value:,}"
    return escape(str(value))


def _figures(items: list[tuple[str, str]]) -> str:
    return '<div class="figures">' + "".join(f'<div class="figure"><b>{escape(v)}</b><span>{escape(k)}</span></div>'
                                             for k, v in items) + "</div>"


def _header(manifest: dict, stats: list[ShardStats], status: str, root: str, warning: str) -> str:
    total = Counters.total(stats)
    generating = busy_seconds((s.started_at, s.finished_at) for s in stats)
    planned = manifest.get("shards_planned")
    shards = f"{len(stats)} of {planned}" if planned else str(len(stats))
    return (f'<h1>{escape(manifest["name"])} <span class="status {status}">{status}</span></h1>'
            f'<div class="note">{escape(root)} · started {_when(manifest.get("started"))}</div>{warning}'
            + _figures([("shards committed", shards), ("rows", f"{total.rows:,}"), ("failed rows", f"{total.failed_rows:,}"),
                        ("generated tokens", f"{total.generated_tokens:,}"),
                        ("tokens/s while generating", f"{total.generated_tokens / generating:,.1f}" if generating else "–"),
                        ("tokens per row per target pass", f"{total.tokens_per_row_pass:.2f}"),
                        ("acceptance", f"{total.acceptance_rate:.2f}"),
                        ("generating time", f"{generating:,.1f} s")]))


def _by_worker(stats: list[ShardStats]) -> dict[str, list[ShardStats]]:
    workers: dict[str, list[ShardStats]] = defaultdict(list)
    for s in sorted(stats, key=lambda s: (s.worker_id, s.started_at)):
        workers[s.worker_id].append(s)
    return dict(workers)


def _throughput(stats: list[ShardStats], load: MachineLoad | None, warning: str) -> str:
    if not stats:
        return "<h2>Throughput</h2><p>No shard has been committed yet.</p>"
    t0 = min(s.started_at for s in stats)
    over_time = {w: [[(s.started_at - t0, s.tokens_per_s), (s.finished_at - t0, s.tokens_per_s)] for s in shards]
                 for w, shards in _by_worker(stats).items()}
    ordered = sorted(stats, key=lambda s: s.shard_id)
    workers = list(_by_worker(stats))
    per_shard = {w: [s.tokens_per_s if s.worker_id == w else 0.0 for s in ordered] for w in workers}
    slowest = sorted(stats, key=lambda s: s.wall_s, reverse=True)[:min(10, SHOWN_ROWS)]
    return ("<h2>Throughput</h2>"
            + line_chart(over_time, "throughput over time per worker", "seconds since the first shard started",
                         "tokens/s (each shard)")
            + bar_chart([s.shard_id.removeprefix("shard-").lstrip("0") or "0" for s in ordered], per_shard,
                        "tokens/s per shard", "shard", "tokens/s")
            + "<h3>Slowest shards</h3>"
            + _table(["shard", "worker", "rows", "tokens", "wall s", "tokens/s", "attempt"],
                     [[s.shard_id, s.worker_id, s.rows, s.generated_tokens, s.wall_s, s.tokens_per_s, s.attempt]
                      for s in slowest], numeric={2, 3, 4, 5, 6})
            + _pass_times(stats, load, warning))


def _pass_times(stats: list[ShardStats], load: MachineLoad | None, warning: str) -> str:
    """Each shard's ms per target pass, slowest first, and whether they disagree enough to blame the machine."""
    times = ms_per_pass(stats)
    found = spread(times)
    if found is None:
        return "<h3>Time per target pass</h3><p>Fewer than two shards made enough target passes to compare.</p>"
    machine = f" At the end of the last run: {escape(load_text(load))}." if load else ""
    judged = warning or (f"<p>Shards agree within {found.ratio:.1f}x (the limit is {SPREAD_LIMIT:g}x): "
                         f"a steady machine.{machine}</p>")
    by_id = {s.shard_id: s for s in stats}
    slowest = sorted(times, key=times.__getitem__, reverse=True)[:SHOWN_ROWS]
    return ("<h3>Time per target pass</h3>" + judged
            + _table(["shard", "worker", "target passes", "ms per pass", "× fastest"],
                     [[i, by_id[i].worker_id, by_id[i].target_passes, times[i], times[i] / found.fastest_ms]
                      for i in slowest], numeric={2, 3, 4}))


def _plan(store: Store, stats: list[ShardStats]) -> str:
    """`specbatch plan`'s prediction beside what the job measured, when a plan was made for this output."""
    plan = store.read_json(PLAN_FILE)
    if not plan or not stats:
        return ""
    p = plan["predicted"]
    measured = {"output rows": sum(s.rows for s in stats), "generated tokens": sum(s.generated_tokens for s in stats),
                "generating s (one worker)": sum(generating_s(s) for s in stats)}
    predicted = {"output rows": p["output_rows"], "generated tokens": p["generated_tokens"],
                 "generating s (one worker)": p["generating_s_one_worker"]}
    where = f"simulated for {plan['simulated_on']}" if plan.get("simulated_on") else f"measured on {plan.get('measured_on')}"
    rows = [[name, predicted[name], value, f"{(predicted[name] - value) / value:+.0%}" if value else "–"]
            for name, value in measured.items()]
    return (f"<h2>Plan against the result</h2><p>The plan ({escape(where)}, a {plan['sample']['rows']}-row pilot) "
            f"predicted the job at its settings; the committed shards measured:</p>"
            + _table(["figure", "predicted", "measured", "error"], rows, numeric={1, 2}))


def _drafters(learning: dict | None, stats: list[ShardStats]) -> str:
    """Shards by the drafter that drafted them, and what a learning job's distillation did and cost: a learning
    job's shards before and after its switch, side by side."""
    by_drafter: dict[str, list[ShardStats]] = {}
    for s in stats:
        by_drafter.setdefault(s.drafter or "not recorded", []).append(s)
    if not learning and len(by_drafter) < 2:
        return ""
    rows = []
    for name, shards in by_drafter.items():
        t, busy = Counters.total(shards), sum(generating_s(s) for s in shards)
        rows.append([name, len(shards), t.rows, t.generated_tokens, t.generated_tokens / busy if busy else 0.0,
                     t.acceptance_rate, t.tokens_per_row_pass])
    text = ""
    if learning:
        figures = [("status", learning["status"])]
        figures += [(label, f"{learning[key]:{fmt}}") for key, label, fmt in
                    (("after_rows", "distillation started after rows", "d"),
                     ("distill_s", "distillation took (s, beside generation)", ".0f"), ("steps", "training steps", "d"))
                    if learning.get(key) is not None]
        if learning.get("heldout_accept_by_position"):
            figures.append(("held-out acceptance by draft position (each given the earlier ones)",
                            " ".join(f"{a:.2f}" for a in learning["heldout_accept_by_position"])))
        text = "<p>The job distilled its own MTP head from its committed completions.</p>" + _figures(figures)
    return ("<h2>Drafters</h2>" + text
            + _table(["drafter", "shards", "rows", "generated tokens", "tokens/s while generating", "acceptance",
                      "tokens per row per pass"], rows, numeric={1, 2, 3, 4, 5, 6}))


def _speculation(manifest: dict, stats: list[ShardStats]) -> str:
    config = manifest["config"]
    drafter, k = config["model"]["drafter"], config["speculation"]["k"]
    named = f"drafter <b>{escape(str(drafter))}</b>, k = <b>{escape(str(k))}</b> (max_k {config['speculation']['max_k']})"
    totals = {w: Counters.total(shards) for w, shards in _by_worker(stats).items()}
    if not any(t.attempted_by_position for t in totals.values()):
        return f"<h2>Speculation</h2><p>{named}: no draft tokens were proposed.</p>"
    acceptance = {w: [[(i + 1, a) for i, a in enumerate(t.accept_by_position) if a is not None]] for w, t in totals.items()}
    width = max(len(t.k_hist) for t in totals.values())
    k_share = {w: [(t.k_hist[k] if k < len(t.k_hist) else 0) / max(sum(t.k_hist), 1) for k in range(width)]
               for w, t in totals.items()}
    rows = [[w, t.drafted_tokens, t.accepted_tokens, t.acceptance_rate, t.tokens_per_row_pass, t.batch_tokens_per_pass]
            for w, t in totals.items()]
    return (f"<h2>Speculation</h2><p>{named}.</p>"
            + _table(["worker", "drafted", "accepted", "acceptance", "tokens per row per pass", "tokens per batch pass"],
                     rows, numeric={1, 2, 3, 4, 5})
            + line_chart(acceptance, f"acceptance by draft position ({drafter})", "draft position",
                         "accepted, given the earlier ones were", y_max=1.0, markers=True)
            + bar_chart([str(k) for k in range(width)], k_share, f"k chosen per target pass ({drafter}, k = {k})",
                        "k (draft tokens per pass)", "share of target passes", y_max=1.0))


def _rows(stats: list[ShardStats], failed: list[dict]) -> str:
    total = Counters.total(stats)
    reasons = [("stop (EOS or stop string)", total.stop_rows), ("length (max_new_tokens)", total.length_rows),
               ("error", total.failed_rows)]
    part = "<h2>Rows</h2>" + _table(["finish reason", "rows"], [list(r) for r in reasons], numeric={1})
    if failed:
        more = f" (the first {SHOWN_ROWS}; all are in errors.parquet)" if len(failed) > SHOWN_ROWS else ""
        part += (f"<h3>Failed rows{more}</h3>"
                 + _table(["id", "sample", "error"], [[r["id"], r["sample_index"], r["error"]] for r in failed[:SHOWN_ROWS]],
                          numeric={1}))
    return part


def _samples(store: Store) -> str:
    """A few completions, per category or task where the output kept such a column; every cell escaped."""
    samples = read_samples(store, SAMPLES_PER_GROUP, SAMPLE_GROUPS)
    if not samples.rows:
        return ""
    group = [samples.group_column] if samples.group_column else []
    rows = [[*(str(r[c]) for c in group), r["id"], clip(r["prompt"], 300),
             r["error"] if r["error"] else clip(r["completion"], 600), r["finish_reason"], r["completion_tokens"] or 0]
            for r in samples.rows]
    text = {len(group) + 1, len(group) + 2}
    return ("<h2>Sample completions</h2>"
            f'<p class="note">From the first data files{" per " + escape(group[0]) if group else ""}; '
            "all rows are in data/*.parquet.</p>"
            + _table([*group, "id", "prompt", "completion", "finish", "tokens"], rows, numeric={len(group) + 4}, text=text))


def _runs(manifest: dict, stats: list[ShardStats], retries: list[dict]) -> str:
    resumed = [s for s in stats if s.run_id != manifest.get("run_id")]
    part = (f"<h2>Runs, resumes and retries</h2><p>Latest run {escape(str(manifest.get('run_id')))} started "
            f"{_when(manifest.get('run_started'))}; {len(resumed)} of {len(stats)} committed shards were made by "
            f"earlier runs and resumed.</p>")
    if resumed:
        part += _table(["resumed shard", "run", "finished"], [[s.shard_id, s.run_id, _when(s.finished_at)]
                                                              for s in resumed[:SHOWN_ROWS]])
    if retries:
        part += (f"<h3>Failed attempts ({len(retries)})</h3>"
                 + _table(["shard", "attempt", "worker", "when", "reason"],
                          [[r["shard_id"], r["attempt"], r["worker_id"], _when(r["at"]), r["reason"][:300]]
                           for r in retries[:SHOWN_ROWS]], numeric={1}))
    else:
        part += "<p>No attempt failed.</p>"
    return part


def _workers(stats: list[ShardStats]) -> str:
    rows = []
    for worker, shards in _by_worker(stats).items():
        t = Counters.total(shards)
        rows.append([worker, ", ".join(sorted({s.node for s in shards})),
                     ", ".join(sorted({s.ray_node_id for s in shards if s.ray_node_id})) or "–",
                     ", ".join(sorted({s.device for s in shards})),
                     len(shards), t.rows, t.generated_tokens, t.tokens_per_s,
                     f"{max(s.peak_mem_bytes for s in shards) / 2**20:,.0f}"])
    return ("<h2>Workers</h2>" + _table(["worker", "host", "Ray node id", "device", "shards", "rows", "tokens",
                                         "tokens/s (busy)", "peak MiB"], rows, numeric={4, 5, 6, 7, 8}))


def _setup(manifest: dict) -> str:
    versions = manifest.get("versions", {})
    return ("<h2>Config and versions</h2><p class=\"note\">Secrets are redacted.</p>"
            f"<pre>{escape(yaml.safe_dump(manifest['config'], sort_keys=False))}</pre>"
            + _table(["package", "version"], [[k, v] for k, v in versions.items()]))
