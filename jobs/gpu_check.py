"""`make gpu-check` (python -m jobs.gpu_check): every check that needs a GPU, in one run of under 10 minutes
on one GPU, for the day one is lent. First greedy equality in fp32 on CUDA (every cell's output against
transformers' greedy `generate` and against our own k = 0), then the bf16 benchmark of
configs/bench-gpu.yaml: throughput at batch 1/16/64/128 and compiled against eager passes.

Exit status 0 when every row matched, 1 otherwise; the tables land in OUT/fp32-exactness and OUT/bf16.
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from jobs.bench import benchmark
from jobs.bench.config import BenchError, load_bench_config

EXACTNESS = {"model": {"dtype": "float32", "compile": False},
             "mix": True, "batch_sizes": [1, 16], "ks": [0, 4], "repeats": 1, "reference_rows": 4,
             "max_new_tokens": 32, "prompt_lookup": False, "pipeline": {"enabled": False}, "passes": {"enabled": False}}


def mismatches(results: list[dict]) -> list[str]:
    """Cells of ours where some row differs from transformers' greedy output or from our own k = 0."""
    return [f"{r['workload']} batch {r['batch_size']} {r['system']}: {r['rows_matching']}/{r['rows_checked']} equal "
            f"transformers, {r['rows_as_k0']}/{r['rows']} equal k=0" for r in results
            if r["family"] == "specbatch" and (r["rows_matching"] != r["rows_checked"] or r["rows_as_k0"] != r["rows"])]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default="configs/bench-gpu.yaml")
    p.add_argument("--out", default="gpu-out")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself")
    p.add_argument("--quick", action="store_true", help="the bf16 part's quick section")
    args = p.parse_args(argv)
    out, command = Path(args.out), f"python -m jobs.gpu_check --config {args.config} --out {args.out}"
    try:
        exact = load_bench_config(args.config, overrides={**EXACTNESS, "device": args.device})
        different = mismatches(benchmark(exact, out / "fp32-exactness", command + " (fp32 exactness)"))
        speed = load_bench_config(args.config, args.quick, overrides={"device": args.device})
        benchmark(speed, out / "bf16", command + f" ({speed.model.dtype} throughput)", args.quick)
    except BenchError as exc:
        print(f"gpu-check: {exc}", file=sys.stderr)
        return 2
    print("\n".join(["gpu-check: every row equal to transformers' greedy output and to k=0 in fp32"] if not different
                    else ["gpu-check: rows that DIFFER in fp32:", *different]), file=sys.stderr)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
