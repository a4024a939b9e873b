"""The job's closing artefacts: stats/shards.parquet, summary.json and _SUCCESS."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq

from pipeline.job_state import JobState
from workers.schemas import STATS_SCHEMA
from workers.storage import write_bytes_atomic


def summarize(stats: list[dict], wall_s: float, shards_skipped: int, output: str) -> dict:
    """Job totals. Throughput counts only what this run generated, over this run's wall time."""
    run = [s for s in stats if not s.get("skipped")]
    generated = sum(s["generated_tokens"] for s in run)
    drafted = sum(s["drafted_tokens"] for s in stats)
    passes = sum(s["target_passes"] for s in stats)
    return {
        "rows": sum(s["rows"] for s in stats),
        "generated_tokens": sum(s["generated_tokens"] for s in stats),
        "wall_s": round(wall_s, 3),
        "tokens_per_s": round(generated / wall_s, 2) if wall_s else 0.0,
        "acceptance_rate": round(sum(s["accepted_tokens"] for s in stats) / drafted, 4) if drafted else 0.0,
        "mean_accepted_per_pass": round(sum(s["generated_tokens"] for s in stats) / passes, 4) if passes else 0.0,
        "shards": len(stats),
        "shards_skipped": shards_skipped,
        "failed_rows": sum(s["failed_rows"] for s in stats),
        "output": output,
    }


def write_report(state: JobState, stats: list[dict], summary: dict) -> None:
    rows = sorted(({k: s.get(k) for k in STATS_SCHEMA.names} for s in stats), key=lambda s: s["shard_id"])
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=STATS_SCHEMA), sink)
    write_bytes_atomic(state.url("stats", "shards.parquet"), sink.getvalue().to_pybytes(), state.options)
    state.write_json(summary, "summary.json")
    write_bytes_atomic(state.url("_SUCCESS"), b"", state.options)
