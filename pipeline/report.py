"""OUTPUT/report.html: one self-contained page (inline CSS and SVG, no script, no network) about a job.

Built only from what the output folder holds (_job.json, the lease, stats parts, retries, errors),
so `specbatch report OUTPUT` can rebuild it for a finished job, a stopped one or one still running.
"""
from __future__ import annotations

import datetime
import json
from collections import defaultdict
from html import escape

import pyarrow.parquet as pq
import yaml

from pipeline.job_state import LEASE, MANIFEST, committed_shards, lease_alive
from pipeline.summary import busy_seconds, failed_rows
from pipeline.svg import bar_chart, line_chart
from workers.schemas import Counters, ShardStats
from workers.storage import Store

SHOWN_ROWS = 50  # rows of the longer tables (slowest shards, failed rows, retries)

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
"""


def write_report(store: Store, stats: list[ShardStats] | None = None) -> str:
    """Build the report (from `stats`, or from the committed shards' parts) and write it; return its URL."""
    store.write(build_report(store, stats).encode(), "report.html")
    return store.url("report.html")


def build_report(store: Store, stats: list[ShardStats] | None = None) -> str:
    manifest = store.read_json(MANIFEST)
    if manifest is None:
        raise FileNotFoundError(f"{store.root} holds no specbatch job (no {MANIFEST})")
    stats = sorted(committed_shards(store).values() if stats is None else stats, key=lambda s: s.shard_id)
    retries = sorted((json.loads(store.read("stats", "retries", url.rsplit("/", 1)[-1]))
                      for url in store.list("stats", "retries", suffixes=[".json"])), key=lambda r: r["at"])
    failed = (store.apply(lambda fs, path: pq.read_table(path, filesystem=fs), "read", "errors.parquet")
              if store.exists("errors.parquet") else failed_rows(store, stats)).to_pylist()
    lease = store.read_json(LEASE)
    status = ("finished" if store.exists("_SUCCESS") else "running" if lease and lease_alive(lease) else "incomplete")
    body = [_header(manifest, stats, status, store.root), _throughput(stats), _speculation(manifest, stats),
            _rows(stats, failed), _runs(manifest, stats, retries), _workers(stats), _setup(manifest)]
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>{escape(manifest["name"])} – '
            f'specbatch report</title><style>{CSS}</style></head><body>{"".join(body)}'
            f'<p class="note">Written {_when(datetime.datetime.now().timestamp())} by specbatch report.</p></body></html>')


def _when(epoch: float | None) -> str:
    return datetime.datetime.fromtimestamp(epoch).strftime("%Y-%m-%d %H:%M:%S") if epoch else "–"


def _table(header: list[str], rows: list[list], numeric: set[int] = frozenset()) -> str:
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f'<td class="n">{_cell(v)}</td>' if i in numeric else f"<td>{_cell(v)}</td>"
                                    for i, v in enumerate(row)) + "</tr>" for row in rows)
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


def _header(manifest: dict, stats: list[ShardStats], status: str, root: str) -> str:
    total = Counters.total(stats)
    generating = busy_seconds((s.started_at, s.finished_at) for s in stats)
    planned = manifest.get("shards_planned")
    shards = f"{len(stats)} of {planned}" if planned else str(len(stats))
    return (f'<h1>{escape(manifest["name"])} <span class="status {status}">{status}</span></h1>'
            f'<div class="note">{escape(root)} · started {_when(manifest.get("started"))}</div>'
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


def _throughput(stats: list[ShardStats]) -> str:
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
                      for s in slowest], numeric={2, 3, 4, 5, 6}))


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
        rows.append([worker, ", ".join(sorted({s.node for s in shards})), ", ".join(sorted({s.device for s in shards})),
                     len(shards), t.rows, t.generated_tokens, t.tokens_per_s,
                     f"{max(s.peak_mem_bytes for s in shards) / 2**20:,.0f}"])
    return ("<h2>Workers</h2>" + _table(["worker", "node", "device", "shards", "rows", "tokens", "tokens/s (busy)",
                                         "peak MiB"], rows, numeric={3, 4, 5, 6, 7}))


def _setup(manifest: dict) -> str:
    versions = manifest.get("versions", {})
    return ("<h2>Config and versions</h2><p class=\"note\">Secrets are redacted.</p>"
            f"<pre>{escape(yaml.safe_dump(manifest['config'], sort_keys=False))}</pre>"
            + _table(["package", "version"], [[k, v] for k, v in versions.items()]))
