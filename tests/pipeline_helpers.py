"""Configs and checks shared by the end-to-end tests (the fixtures they use live in conftest.py)."""
from __future__ import annotations

import collections

import pyarrow.parquet as pq

from workers.config import JobConfig
from workers.schemas import ShardStats
from workers.storage import filesystem, list_files, read_bytes


def make_config(model_dir: str, input_path: str, output_path: str, **sections) -> JobConfig:
    base = {
        "name": "t",
        "input": {"path": input_path},
        "output": {"path": output_path},
        "model": {"target": model_dir, "drafter": "ngram"},
        "generation": {"max_new_tokens": 12},
        "resources": {"workers": 1, "cpus_per_worker": 0.5, "batch_size": 4},
        "sharding": {"rows_per_shard": 4},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return JobConfig.model_validate(base)


def read_output(config: JobConfig):
    urls = list_files(config.output.path.rstrip("/") + "/data", config.output.storage_options, [".parquet"])
    fs, _ = filesystem(config.output.path, config.output.storage_options)
    tables = [pq.read_table(filesystem(u, config.output.storage_options)[1], filesystem=fs) for u in urls]
    return [row for t in tables for row in t.to_pylist()]


def assert_exactly_once(config: JobConfig, ids: list[str], samples: int = 1) -> list[dict]:
    rows = read_output(config)
    counts = collections.Counter(r["id"] for r in rows)
    assert counts == {i: samples for i in ids}
    for i in ids:
        assert sorted(r["sample_index"] for r in rows if r["id"] == i) == list(range(samples))
    assert read_bytes(config.output.path.rstrip("/") + "/_SUCCESS", config.output.storage_options) == b""
    return rows


def prompts(n: int, prefix: str = "p") -> list[dict]:
    words = ["the quick brown fox", "rewrite this sentence", "def add(a, b)", "why is the sky blue"]
    return [{"id": f"{prefix}{i}", "prompt": f"{words[i % 4]} {i}", "task": words[i % 4][:3]} for i in range(n)]


def shard(i: int, worker: str, run_id: str, failed: int = 0, attempt: int = 1) -> ShardStats:
    """A plausible committed shard's record: 4 rows, 3 draft positions, k up to 3, i-dependent timing and tokens."""
    start = 1_700_000_000.0 + 3 * i
    return ShardStats(shard_id=f"shard-{i:05d}", worker_id=worker, node="node-a", device="cpu", run_id=run_id,
                      attempt=attempt, started_at=start, finished_at=start + 2.5 + i % 3, peak_mem_bytes=2**30,
                      rows=4, stop_rows=2, length_rows=2 - failed, failed_rows=failed, prompt_tokens=40,
                      generated_tokens=60 + 7 * i, target_passes=20, row_passes=70, draft_passes=0,
                      drafted_tokens=90, accepted_tokens=30 + i, wall_s=2.5 + i % 3, prefill_s=0.1, draft_s=0.2,
                      verify_s=2.0, attempted_by_position=[60, 30, 12], accepted_by_position=[30, 12, 5],
                      k_hist=[2, 3, 15, 0])


def run_in_process(config: JobConfig) -> dict:
    """A whole job without Ray: plan, claim the output, run every shard on one ShardRunner, write the closing
    files and the report, as run_job does. For tests that need a real output folder in seconds."""
    import time

    from pipeline.job_state import JobState
    from pipeline.planner import plan_job
    from pipeline.report import write_report
    from pipeline.summary import RunInfo, summarize, write_closing_files
    from workers.shard_runner import ShardRunner

    plan, state = plan_job(config), JobState(config)
    state.claim(False, len(plan.shards))
    runner = ShardRunner(config)
    stats = [runner.run(spec, 1, state.run_id) for spec in plan.shards]
    summary = summarize(stats, RunInfo(state.run_id, state.started, time.time() - state.started, len(stats)),
                        config.output.path)
    write_closing_files(state.store, stats, summary)
    write_report(state.store, stats)
    state.release()
    return summary
