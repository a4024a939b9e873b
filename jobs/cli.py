"""The `specbatch` command line."""
from __future__ import annotations

import argparse
import json
import logging
import sys

from pipeline.job_config import ConfigError, load_config


def _run(args: argparse.Namespace) -> int:
    from pipeline.driver import run_job  # imports Ray and torch: only for commands that need them

    config = load_config(args.config, args.set)
    summary = run_job(config, overwrite=args.overwrite, address=args.address, progress=not args.quiet)
    print(json.dumps(summary, indent=2) if args.json else _describe(summary))
    return 0


def _describe(summary: dict) -> str:
    return (f"{summary['rows']} rows, {summary['generated_tokens']} tokens in {summary['wall_s']:.1f}s "
            f"({summary['tokens_per_s']:.1f} tokens/s), acceptance {summary['acceptance_rate']:.2f}, "
            f"{summary['mean_accepted_per_pass']:.2f} tokens per target pass, {summary['shards']} shards "
            f"({summary['shards_skipped']} resumed), {summary['failed_rows']} failed rows\n"
            f"output: {summary['output']}")


def _bench(args: argparse.Namespace) -> int:
    from jobs.bench import run_bench

    return run_bench(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specbatch", description="Offline batch generation with adaptive speculative decoding on Ray.")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job (local Ray by default) and wait for it")
    run.add_argument("config", help="job YAML (local path or URL)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    run.add_argument("--overwrite", action="store_true", help="replace output written by a different config")
    run.add_argument("--address", default=None, help="attach to a Ray cluster ('auto' or HOST:PORT) instead of starting one")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.set_defaults(func=_run)
    bench = sub.add_parser("bench", help="side-by-side speed benchmark against transformers")
    bench.add_argument("--config", default="configs/bench.yaml")
    bench.add_argument("--quick", action="store_true", help="a few minutes on a laptop CPU")
    bench.add_argument("--out", default="bench-out", help="folder for results.parquet, results.md, plot.png")
    bench.set_defaults(func=_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    args = parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted: committed shards are kept; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
