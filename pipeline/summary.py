"""The job's closing files: stats/shards.parquet, errors.parquet, summary.json, _SUCCESS.

The summary keeps the whole job's figures (every committed shard, whichever run made it) apart from
this run's, so a rerun that resumes, or finds nothing to do, never overwrites the job's numbers.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipeline.noise import MachineLoad, noise_summary
from workers.schemas import STATS_SCHEMA, Counters, ShardStats
from workers.storage import Store

ERROR_COLUMNS = ["id", "sample_index", "prompt", "error"]


@dataclass(frozen=True)
class RunInfo:
    """This driver run: its id, when it started, how long it took, how many shards it generated, and what else
    the machine was doing meanwhile."""

    run_id: str
    started: float
    wall_s: float
    shards_run: int
    load: MachineLoad | None = None


def busy_seconds(intervals: Iterable[tuple[float, float]]) -> float:
    """Seconds during which at least one interval was open: the time the job spent generating,
    which leaves out the pauses between runs and start-up."""
    busy, end = 0.0, float("-inf")
    for start, stop in sorted(intervals):
        if stop > end:
            busy += stop - max(start, end)
            end = stop
    return busy


def summarize(stats: list[ShardStats], run: RunInfo, output: str) -> dict:
    """Whole-job totals over every committed shard, and this run's own figures."""
    total = Counters.total(stats)
    generating = busy_seconds((s.started_at, s.finished_at) for s in stats)
    mine = [s for s in stats if s.run_id == run.run_id]
    run_tokens = sum(s.generated_tokens for s in mine)
    job = {"shards": len(stats), **total.counters(), "generating_s": generating,
           "tokens_per_s": total.generated_tokens / generating if generating else 0.0,
           "started_at": min((s.started_at for s in stats), default=None),
           "finished_at": max((s.finished_at for s in stats), default=None)}
    job.pop("wall_s")  # summed over shards it is worker-seconds, not the job's time: see generating_s
    return {
        "output": output,
        "job": _rounded(job),
        "this_run": _rounded({"run_id": run.run_id, "shards_run": run.shards_run,
                              "shards_resumed": len(stats) - run.shards_run, "rows": sum(s.rows for s in mine),
                              "generated_tokens": run_tokens, "wall_s": run.wall_s,
                              "tokens_per_s": run_tokens / run.wall_s if run.wall_s else 0.0}),
        "noise": noise_summary(stats, run.load),
    }


def _rounded(figures: dict) -> dict:
    return {k: round(v, 4) if isinstance(v, float) else v for k, v in figures.items()}


def failed_rows(store: Store, stats: Iterable[ShardStats]) -> pa.Table:
    """id, sample_index, prompt and error of every failed row, read only from the shards that have some."""
    tables = []
    for s in sorted(stats, key=lambda s: s.shard_id):
        if s.failed_rows:
            table = store.apply(lambda fs, path: pq.read_table(path, filesystem=fs, columns=[*ERROR_COLUMNS, "finish_reason"]),
                                "read", "data", f"{s.shard_id}.parquet")
            tables.append(table.filter(pc.equal(table["finish_reason"], "error")).select(ERROR_COLUMNS))
    return pa.concat_tables(tables) if tables else pa.table({c: pa.array([], pa.string()) for c in ERROR_COLUMNS})


def write_closing_files(store: Store, stats: list[ShardStats], summary: dict) -> None:
    """stats/shards.parquet and summary.json; errors.parquet when rows failed (a retry job's input); _SUCCESS last."""
    rows = [s.to_row() for s in sorted(stats, key=lambda s: s.shard_id)]
    store.write(_parquet(pa.Table.from_pylist(rows, schema=STATS_SCHEMA)), "stats", "shards.parquet")
    if summary["job"]["failed_rows"]:
        store.write(_parquet(failed_rows(store, stats)), "errors.parquet")
    store.write_json(summary, "summary.json")
    store.write(b"", "_SUCCESS")


def _parquet(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    return sink.getvalue().to_pybytes()
