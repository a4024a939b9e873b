"""The `specbatch` command line."""
from __future__ import annotations

import argparse
import json
import logging
import signal
import sys

from jobs.describe import describe
from pipeline.config_file import ConfigError, load_config
from pipeline.job_state import installed_version
from workers.engine.costs import HARDWARE as HARDWARE_NAMES, load_shape  # numpy only: the CLI stays light


EXIT_FAILED_ROWS = 3  # the job finished (_SUCCESS written) but more rows failed than output.max_failed_rows
EXIT_VERIFY_MISMATCH = 4  # --verify-sample found a row that plain greedy decoding does not reproduce


def _terminate(signum, frame):
    """SIGTERM (`specbatch stop`, a scheduler) unwinds like Ctrl-C: actors are killed and the output's
    lease released, so the same command can resume at once. Once connected, Ray's driver puts its own
    SIGTERM handler in place (sys.exit), which unwinds the same `finally` blocks."""
    raise KeyboardInterrupt


def _run(args: argparse.Namespace) -> int:
    from pipeline.job_state import JobState, OutputConflict
    from pipeline.planner import plan_job
    from workers.config import config_warnings
    from workers.shard_io import InputError
    from workers.storage import StorageError

    config = load_config(args.config, overrides(args))
    for warning in config_warnings(config):
        print(f"warning: {warning}", file=sys.stderr)
    if args.verify_sample and config.generation.temperature > 0:
        return _error(ValueError("--verify-sample compares tokens with plain greedy decoding, which only sampling-free "
                                 "jobs reproduce (generation.temperature is "
                                 f"{config.generation.temperature:g}; sampled output matches the target's "
                                 "distribution, not its tokens)"))
    expected = (InputError, StorageError, FileNotFoundError, OutputConflict)
    try:
        plan = plan_job(config)  # bad input, a missing model or a taken output fails here, before Ray and torch load
        JobState(config).check(args.overwrite)
    except expected as exc:
        return _error(exc)
    from pipeline.driver import JobFailed, ResourceError, run_job

    signal.signal(signal.SIGTERM, _terminate)
    try:
        summary = run_job(config, overwrite=args.overwrite, address=args.address, progress=not args.quiet, plan=plan,
                          verbose=args.verbose, verify_sample=args.verify_sample)
    except (*expected, ResourceError, JobFailed) as exc:
        return _error(exc)
    print(json.dumps(summary, indent=2) if args.json else describe(summary))
    failed, allowed = summary["job"]["failed_rows"], config.output.max_failed_rows
    if failed > allowed:
        print(f"error: {failed} rows failed (output.max_failed_rows is {allowed}); they are listed in "
              f"{summary['output'].rstrip('/')}/errors.parquet, which a retry job can take as its input",
              file=sys.stderr)
        return EXIT_FAILED_ROWS
    if summary.get("verify_sample", {}).get("mismatches"):
        return EXIT_VERIFY_MISMATCH
    return 0


def overrides(args: argparse.Namespace) -> list[str]:
    """The --set overrides, with --limit N as the input.limit it stands for."""
    return args.set + ([f"input.limit={args.limit}"] if args.limit is not None else [])


def _error(exc: Exception) -> int:
    print(f"error: {exc}", file=sys.stderr)
    return 1


def _submit(args: argparse.Namespace) -> int:
    from jobs import cluster

    job_id = cluster.submit(args.address, args.config, overrides(args), args.overwrite, args.env)
    print(job_id)
    if not args.wait:
        return 0
    state = cluster.follow(args.address, job_id)
    print(f"{job_id}: {state}", file=sys.stderr)
    return 0 if state == "SUCCEEDED" else 1


def _status(args: argparse.Namespace) -> int:
    from jobs import cluster

    print(cluster.status_line(cluster.info(args.address, args.job)))
    return 0


def _logs(args: argparse.Namespace) -> int:
    from jobs import cluster

    if args.follow:
        state = cluster.follow(args.address, args.job)
        print(f"{args.job}: {state}", file=sys.stderr)
        return 0
    sys.stdout.write(cluster.logs(args.address, args.job))
    return 0


def _stop(args: argparse.Namespace) -> int:
    from jobs import cluster

    if not cluster.stop(args.address, args.job):
        print(f"{args.job} had already ended: {cluster.status_of(args.address, args.job)}")
        return 0
    if args.wait:
        print(f"{args.job}: {cluster.wait(args.address, args.job, timeout_s=60)}")
    else:
        print(f"stop requested for {args.job}")
    return 0


def _list(args: argparse.Namespace) -> int:
    from jobs import cluster

    print(cluster.list_table(cluster.list_jobs(args.address, args.all)))
    return 0


def _report(args: argparse.Namespace) -> int:
    from pipeline.report import write_report
    from workers.storage import Store, StorageError, absolute, safe_url

    try:
        print(safe_url(write_report(Store(absolute(args.output)))))
    except (FileNotFoundError, StorageError) as exc:
        return _error(exc)
    return 0


def _show(args: argparse.Namespace) -> int:
    from jobs.show import show
    from workers.storage import Store, StorageError, absolute

    try:
        print(show(Store(absolute(args.output)), args.rows))
    except (FileNotFoundError, StorageError) as exc:
        return _error(exc)
    return 0


def _plan(args: argparse.Namespace) -> int:
    from pipeline.planner import plan_job
    from workers.shard_io import InputError
    from workers.storage import StorageError

    config = load_config(args.config, args.set)
    expected = (InputError, StorageError, FileNotFoundError)
    try:
        if args.shape:
            load_shape(args.shape, args.hardware)
        plan_job(config)  # the same fast checks as run, before torch loads
    except (*expected, ValueError) as exc:
        return _error(exc)
    from jobs.plan import describe, make_plan, to_json
    from pipeline.report import PLAN_FILE
    from workers.storage import Store, join, safe_url

    try:
        result = make_plan(config, args.sample, args.hardware, args.workers, args.shape)
    except (*expected, ValueError) as exc:
        return _error(exc)
    Store(config.output.path, config.output.storage_options).write_json(result, PLAN_FILE)  # the report shows it
    print(to_json(result) if args.json else describe(result) + f"\nsaved: {safe_url(join(config.output.path, PLAN_FILE))}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    from jobs.bench import run_bench

    return run_bench(args)


def _distill(args: argparse.Namespace) -> int:
    from jobs.distill import run_distill

    return run_distill(args)


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specbatch", description="Offline batch generation with adaptive speculative decoding on Ray.")
    p.add_argument("--version", action="version", version=f"specbatch {installed_version('specbatch')}")
    sub = p.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run a job (local Ray by default) and wait for it")
    run.add_argument("config", help="job YAML (local path or URL)")
    run.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    run.add_argument("--overwrite", action="store_true", help="replace output written by a different config")
    run.add_argument("--limit", type=int, default=None, metavar="N",
                     help="run only the input's first N rows (input.limit); a later run without it resumes them")
    run.add_argument("--address", default=None,
                     help="attach to a running Ray cluster ('auto', or the head's HOST:PORT) instead of starting one")
    run.add_argument("--quiet", action="store_true", help="no progress bar")
    run.add_argument("--verbose", action="store_true", help="log Ray's and the workers' own messages and progress bars")
    run.add_argument("--json", action="store_true", help="print the summary as JSON")
    run.add_argument("--verify-sample", type=int, default=0, metavar="N",
                     help="afterwards regenerate N rows without speculation and compare token for token "
                          f"(exit {EXIT_VERIFY_MISMATCH} on a difference; greedy jobs only)")
    run.set_defaults(func=_run)

    def cluster_command(name: str, help: str, job: bool = True) -> argparse.ArgumentParser:
        cmd = sub.add_parser(name, help=help)
        cmd.add_argument("--address", default=None, metavar="ADDR",
                         help="the cluster's dashboard, http://HEAD:8265 (default: $RAY_ADDRESS, as Ray's CLI)")
        if job:
            cmd.add_argument("job", help="the submission id printed by `specbatch submit`")
        return cmd

    submit = cluster_command("submit", "submit a job to a Ray cluster (Ray Jobs API) and print its id", job=False)
    submit.add_argument("config", help="job YAML: a local file (uploaded with the job) or a URL the cluster can read")
    submit.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    submit.add_argument("--overwrite", action="store_true", help="replace output written by a different config")
    submit.add_argument("--limit", type=int, default=None, metavar="N", help="run only the input's first N rows")
    submit.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                        help="an environment variable for the job (not secrets: the runtime env is shown in the dashboard)")
    submit.add_argument("--wait", action="store_true", help="follow the logs until the job ends; exit 1 unless it succeeded")
    submit.set_defaults(func=_submit)
    cluster_command("status", "show a submitted job's status").set_defaults(func=_status)
    logs = cluster_command("logs", "print a submitted job's logs")
    logs.add_argument("--follow", "-f", action="store_true", help="keep streaming until the job ends")
    logs.set_defaults(func=_logs)
    stop = cluster_command("stop", "stop a submitted job (committed shards are kept; submit again to resume)")
    stop.add_argument("--wait", action="store_true", help="wait until the job has stopped")
    stop.set_defaults(func=_stop)
    listing = cluster_command("list", "list the specbatch jobs on a cluster", job=False)
    listing.add_argument("--all", action="store_true", help="every job on the cluster, not only specbatch's")
    listing.set_defaults(func=_list)
    report = sub.add_parser("report", help="rebuild OUTPUT/report.html for a finished, stopped or running job")
    report.add_argument("output", help="the job's output.path (credentials for object storage come from the environment)")
    report.set_defaults(func=_report)
    show = sub.add_parser("show", help="print a job's figures and a few completions (from OUTPUT alone)")
    show.add_argument("output", help="the job's output.path (credentials for object storage come from the environment)")
    show.add_argument("--rows", type=int, default=3, metavar="N", help="completions to print (default 3)")
    show.set_defaults(func=_show)
    plan = sub.add_parser("plan", help="predict a job (tokens, time, cost, best drafter, k and batch size) from a pilot "
                                       "on a sample of its input")
    plan.add_argument("config", help="the job YAML")
    plan.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    plan.add_argument("--sample", type=int, default=None, metavar="ROWS",
                      help="input rows in the pilot (default: 2%% of the input, at least 8)")
    plan.add_argument("--hardware", choices=sorted(HARDWARE_NAMES), default=None,
                      help="simulate on this accelerator (roofline of the target's shape; acceptance from the pilot)")
    plan.add_argument("--shape", default=None, metavar="NAME|CONFIG.json",
                      help="with --hardware: price passes for this model shape (configs/shapes: llama-3-8b, ...) "
                           "instead of the target's; the target's pilot still gives acceptance and lengths")
    plan.add_argument("--workers", type=int, default=None, help="workers to divide the job among (default: the config's)")
    plan.add_argument("--json", action="store_true", help="print the plan as JSON")
    plan.set_defaults(func=_plan)
    bench = sub.add_parser("bench", help="side-by-side speed benchmark against transformers")
    bench.add_argument("--config", default="configs/bench.yaml")
    bench.add_argument("--quick", action="store_true", help="a few minutes on a laptop CPU")
    bench.add_argument("--split", choices=["report", "tune"], default=None, help="suite half (default: the config's, report)")
    bench.add_argument("--out", default="bench-out", help="folder for results.parquet, results.md, plot.png")
    bench.set_defaults(func=_bench)
    distill = sub.add_parser("distill", help="build an MTP draft head for a config's target from its own completions")
    distill.add_argument("config", help="the job YAML whose target (and workload) the head is for")
    distill.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="override a config key (repeatable)")
    distill.add_argument("--minutes", type=float, default=20.0, help="wall-clock budget for everything (default 20)")
    distill.add_argument("--steps", type=int, default=None, help="stop training after this many steps")
    distill.add_argument("--out", default=None, help="folder (local or s3://) for the head; default: model.draft")
    distill.add_argument("--from", dest="source", default=None, metavar="OUTPUT_PATH",
                         help="train on a previous job's output instead of generating completions here")
    distill.add_argument("--layers", type=int, default=1, help="decoder blocks in the head (default 1)")
    distill.add_argument("--draft-vocab", type=int, default=8192,
                         help="draft over the V' most frequent completion tokens only (0: the full vocabulary)")
    distill.add_argument("--depth", type=int, default=2, help="chained draft positions unrolled in training")
    distill.add_argument("--heldout", type=float, default=0.1, help="fraction of prompts held out for scoring")
    distill.add_argument("--data-share", type=float, default=0.5,
                         help="without --from: the share of the budget spent generating completions")
    distill.add_argument("--quiet", action="store_true", help="no progress bars")
    distill.set_defaults(func=_distill)
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if getattr(args, "verbose", False) else logging.WARNING,
                        format="%(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except ConfigError as exc:
        print(f"config error: {exc}", file=sys.stderr)
        return 2
    except RuntimeError as exc:
        from jobs.cluster import ClusterError  # light: no Ray import

        if not isinstance(exc, ClusterError):
            raise
        print(f"error: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("interrupted: committed shards are kept; run the same command again to resume", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
