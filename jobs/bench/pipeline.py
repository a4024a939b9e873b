"""The pipeline row: a whole job through Ray (planning, reading, writing, actor start-up and model load
included) against ShardRunner alone on the same rows with the models already loaded, to show what the
pipeline costs on top of the engine."""
from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

import pyarrow.parquet as pq

from jobs.bench.config import BenchConfig, job_config
from jobs.bench.models import BenchModels
from jobs.bench.systems import SPECBATCH
from jobs.bench.timing import timed
from jobs.bench.workloads import Prompt


def _output_matches(output_path: Path, by_id: dict[str, Prompt], references: dict[tuple[int, ...], list[int]]) -> int:
    """Rows of a job's output equal to the greedy reference (rows without one do not count)."""
    rows = [r for f in sorted((output_path / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    return sum(list(r["completion_token_ids"] or []) == references.get(by_id[r["id"]].ids) for r in rows)


def run_pipeline(cfg: BenchConfig, models: BenchModels, workloads: dict[str, list[Prompt]],
                 references: dict[tuple[int, ...], list[int]], log: Callable[[str], None]) -> list[dict]:
    """The same rows through ShardRunner alone and through run_job on local Ray; two result rows."""
    import ray

    from pipeline.driver import run_job
    from pipeline.planner import plan_shards
    from workers.shard_runner import ShardRunner

    p, drafter = cfg.pipeline, cfg.drafters[0]
    prompts = workloads[p.workload]
    by_id = {f"{pr.id}~{c}": pr for c in range(p.copies) for pr in prompts}
    checked = sum(pr.ids in references for pr in by_id.values())
    with tempfile.TemporaryDirectory(prefix="specbatch-bench-") as tmp:
        input_path = Path(tmp) / "prompts.jsonl"
        input_path.write_text("".join(json.dumps({"id": i, "messages": pr.source.chat()}) + "\n" for i, pr in by_id.items()))

        def job(name: str):
            return job_config(cfg, drafter, p.k, p.batch_size, None, str(input_path), str(Path(tmp) / name),
                              p.rows_per_shard)

        log(f"pipeline: {len(by_id)} rows of {p.workload}, batch {p.batch_size}, k={p.k}: ShardRunner alone")
        direct_cfg = job("direct")
        runner = ShardRunner(direct_cfg, "bench-direct", models.by_drafter[drafter])
        direct_stats, direct_wall = timed(models.device, lambda: [runner.run(s) for s in plan_shards(direct_cfg).shards])
        direct_good = _output_matches(Path(tmp) / "direct", by_id, references)

        log("pipeline: the same job through run_job on local Ray")
        ours = not ray.is_initialized()  # stop only a Ray that run_job starts here
        try:
            summary = run_job(job("ray"), overwrite=True, progress=False)
        finally:
            if ours and ray.is_initialized():
                ray.shutdown()
        shard_stats = pq.read_table(Path(tmp) / "ray" / "stats" / "shards.parquet").to_pylist()
        ray_good = _output_matches(Path(tmp) / "ray", by_id, references)

    direct_tokens = sum(s.generated_tokens for s in direct_stats)
    direct_rate = direct_tokens / direct_wall
    in_shards = sum(s["wall_s"] for s in shard_stats)
    common = {"section": "pipeline", "workload": p.workload, "batch_size": p.batch_size, "family": SPECBATCH,
              "drafter": drafter, "k": None if p.k == "adaptive" else p.k,
              "schedule": "adaptive" if p.k == "adaptive" else None, "rows": len(by_id), "repeats": 1,
              "rows_checked": checked}
    direct_row = {**common, "system": "ShardRunner alone", "tokens_per_s": direct_rate, "generated_tokens": direct_tokens,
                  "wall_s": direct_wall, "rows_matching": direct_good, "ratio_vs_direct": 1.0}
    run = summary["this_run"]
    ray_row = {**common, "system": "specbatch job on Ray (run_job)", "tokens_per_s": run["tokens_per_s"],
               "generated_tokens": run["generated_tokens"], "wall_s": run["wall_s"],
               "steady_tokens_per_s": run["generated_tokens"] / in_shards if in_shards else None,
               "startup_s": run["wall_s"] - in_shards, "rows_matching": ray_good,
               "ratio_vs_direct": run["tokens_per_s"] / direct_rate if direct_rate else None}
    ray_row["steady_ratio_vs_direct"] = (ray_row["steady_tokens_per_s"] or 0) / direct_rate if direct_rate else None
    log(f"pipeline: Ray {ray_row['tokens_per_s']:.1f} tok/s end to end ({ray_row['startup_s']:.1f} s outside shards), "
        f"ShardRunner alone {direct_rate:.1f} tok/s: ratio {ray_row['ratio_vs_direct']:.2f}")
    return [ray_row, direct_row]
