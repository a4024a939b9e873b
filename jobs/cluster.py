"""Jobs on a Ray cluster through Ray's Jobs API: submit a config, then status, logs, stop and list.

`submit` validates the config here, then hands the cluster's job scheduler an entrypoint,
`python -m jobs.envcheck && python -m jobs.cli run CONFIG --address auto [--set k=v ...]` (the check
names any missing package and how to install it), with a runtime environment that carries the code
and the config:

- py_modules: the `pipeline`, `workers` and `jobs` package folders (only those: never the
  virtualenv, outputs or caches, whether specbatch runs from a checkout or an installed wheel);
- working_dir: a temporary folder holding a copy of a local config file (a config URL such as
  s3://bucket/job.yaml travels as its URL and is read on the cluster);
- env_vars: PYTHONUNBUFFERED and a few non-secret settings (endpoint, region) when the submitter
  has them set. Credentials never travel: the runtime environment and the entrypoint are shown in
  plain text by `ray job list` and the dashboard, so secret-looking `--env` or `--set` values are
  refused. Credentials come from the cluster (instance roles, its environment) or from the
  config's storage_options.

The cluster must run the same Python packages (Ray, torch, transformers ... as pinned in
pyproject.toml); the job's code comes from the submitter.
"""
from __future__ import annotations

import asyncio
import os
import secrets
import shlex
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

import yaml

from pipeline.config_file import ConfigError, load_config
from workers.config import config_warnings, is_secret, redact
from workers.model_paths import DEMO_MODEL
from workers.storage import is_remote, safe_url

PACKAGES = ("pipeline", "workers", "jobs")
EXCLUDES = ["__pycache__", "*.pyc", ".venv", "venv", ".git", "out", "bench-out", ".cache", ".pytest_cache",
            "*.egg-info", "tests/data"]
# Non-secret settings worth carrying when set where the job is submitted.
PASSTHROUGH_ENV = ("AWS_ENDPOINT_URL", "AWS_ENDPOINT_URL_S3", "AWS_DEFAULT_REGION", "AWS_REGION",
                   "AWS_EC2_METADATA_DISABLED", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")
TERMINAL = ("SUCCEEDED", "FAILED", "STOPPED")
DEFAULT_ADDRESS = "http://127.0.0.1:8265"


class ClusterError(RuntimeError):
    """A cluster command cannot go on; the message says why and what to do."""


_ADDRESS_ENV = ("RAY_API_SERVER_ADDRESS", "RAY_ADDRESS")


def default_address() -> str:
    """Like Ray's own CLI: $RAY_API_SERVER_ADDRESS or $RAY_ADDRESS, else the dashboard on this machine."""
    return next((os.environ[k] for k in _ADDRESS_ENV if os.environ.get(k)), DEFAULT_ADDRESS)


def client(address: str | None):
    """A Jobs API client for `address` (default_address() when None).

    Ray lets $RAY_ADDRESS override even an explicit address; here an explicit --address wins.
    """
    from ray.job_submission import JobSubmissionClient  # Ray's client only; no torch

    address = address or default_address()
    saved = {k: os.environ.pop(k) for k in _ADDRESS_ENV if k in os.environ}
    try:
        return JobSubmissionClient(address)
    except (ConnectionError, ValueError) as exc:
        raise ClusterError(f"cannot reach the Ray cluster at {safe_url(address)}: {exc}") from None
    finally:
        os.environ.update(saved)


def submission_id(name: str) -> str:
    """The config's name, the submit time and a random suffix: readable in `list`, unique per submit."""
    return f"{name}-{time.strftime('%Y%m%d-%H%M%S')}-{secrets.token_hex(3)}"


def check_overrides(overrides: list[str]) -> None:
    """Refuse --set values that redaction would hide: the job's command line is shown in plain text."""
    for override in overrides:
        key, _, text = override.partition("=")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            continue  # load_config reports it
        nested = value
        for part in reversed(key.strip().split(".")):
            nested = {part: nested}
        if redact(nested) != nested:
            raise ClusterError(f"--set {key}: refusing to put a secret on the job's command line (shown by "
                               "`ray job list` and the dashboard); put it in the config's storage_options "
                               "or give the cluster its own credentials")


def job_env(extra: list[str]) -> dict[str, str]:
    env = {"PYTHONUNBUFFERED": "1"}
    env.update({k: os.environ[k] for k in PASSTHROUGH_ENV if os.environ.get(k)})
    for item in extra:
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ClusterError(f"--env {item!r}: expected KEY=VALUE")
        if is_secret(key, value):
            raise ClusterError(f"--env {key}: refusing to put a secret in the job's runtime environment (shown "
                               "by `ray job list` and the dashboard); give the cluster its own credentials")
        env[key] = value
    return env


@dataclass
class Submission:
    submission_id: str
    entrypoint: str
    runtime_env: dict[str, Any]
    metadata: dict[str, str]
    warnings: list[str]


def _warnings(config) -> list[str]:
    return [f"{label} {safe_url(path)} is a local path, read and written on the cluster's nodes; use object "
            "storage (s3://, gs://) or a filesystem every node mounts"
            for label, path in (("input.path", config.input.path), ("output.path", config.output.path))
            if not is_remote(path)] + config_warnings(config)


@contextmanager
def prepared(config_path: str, overrides: list[str], overwrite: bool = False,
             env: list[str] = ()) -> Iterator[Submission]:
    """Validate the config here and build the job's entrypoint and runtime environment.

    The temporary folder holding the config copy lives for the `with` block (Ray uploads it at submit).
    """
    check_overrides(overrides)
    remote = is_remote(config_path)
    warnings: list[str] = []
    try:
        config = load_config(config_path, overrides)
    except ConfigError:  # invalid, or no such file: stop here
        raise
    except Exception as exc:  # a config URL this machine cannot read (no credentials here, perhaps)
        if not remote:
            raise
        config = None  # the cluster validates it when the job starts
        warnings.append(f"could not read {safe_url(config_path)} here ({type(exc).__name__}); "
                        "the cluster will validate it")
    name = config.name if config else Path(config_path.rstrip("/")).stem or "specbatch"
    if config:
        warnings += _warnings(config)
    staging = Path(tempfile.mkdtemp(prefix="specbatch-submit-"))
    try:
        runtime_env: dict[str, Any] = {"py_modules": [_package_dir(p) for p in PACKAGES], "excludes": EXCLUDES,
                                       "env_vars": job_env(list(env))}
        if remote:
            target = config_path
        else:
            local = Path(config_path.removeprefix("file://")).expanduser()
            target = local.name
            shutil.copyfile(local, staging / target)
            runtime_env["working_dir"] = str(staging)
        check = ["python", "-m", "jobs.envcheck"] + (["--demo"] if config and config.model.target == DEMO_MODEL else [])
        args = ["python", "-m", "jobs.cli", "run", target, "--address", "auto"]
        for override in overrides:
            args += ["--set", override]
        if overwrite:
            args.append("--overwrite")
        metadata = {"specbatch": "1", "config": name}
        if config:
            metadata["output"] = safe_url(config.output.path)
        entrypoint = f"{shlex.join(check)} && {shlex.join(args)}"  # missing packages: one clear message first
        yield Submission(submission_id(name), entrypoint, runtime_env, metadata, warnings)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _package_dir(name: str) -> str:
    module = sys.modules.get(name) or __import__(name)
    return str(Path(module.__file__).resolve().parent)


def submit(address: str | None, config_path: str, overrides: list[str], overwrite: bool = False,
           env: list[str] = (), err: TextIO | None = None) -> str:
    """Submit the job and return its submission id (the config is checked before the cluster is called)."""
    with prepared(config_path, overrides, overwrite, env) as sub:
        jobs = client(address)
        for note in sub.warnings:
            print(f"warning: {note}", file=err or sys.stderr)
        return jobs.submit_job(entrypoint=sub.entrypoint, runtime_env=sub.runtime_env,
                               submission_id=sub.submission_id, metadata=sub.metadata)


def info(address: str | None, job_id: str):
    try:
        return client(address).get_job_info(job_id)
    except RuntimeError as exc:
        raise ClusterError(_not_found(job_id, exc)) from None


def _not_found(job_id: str, exc: Exception) -> str:
    text = str(exc)
    if "404" in text or "does not exist" in text:
        return f"no job {job_id!r} on this cluster (see `specbatch list`)"
    return f"job {job_id}: {text}"


def status_line(details) -> str:
    status = str(getattr(details.status, "value", details.status))
    line = f"{details.submission_id or details.job_id}: {status}"
    if details.start_time:
        end = details.end_time or time.time() * 1000
        line += f" ({(end - details.start_time) / 1000:.0f}s)"
    if details.message and status != "SUCCEEDED":
        line += f"\n{details.message.strip()}"
    return line


def status_of(address: str | None, job_id: str) -> str:
    details = info(address, job_id)
    return str(getattr(details.status, "value", details.status))


def logs(address: str | None, job_id: str) -> str:
    try:
        return client(address).get_job_logs(job_id)
    except RuntimeError as exc:
        raise ClusterError(_not_found(job_id, exc)) from None


def follow(address: str | None, job_id: str, out: TextIO | None = None) -> str:
    """Stream the job's logs until it ends; return its final status."""
    out = out or sys.stdout
    jobs = client(address)
    info(address, job_id)  # a clear error for an unknown id before opening the stream

    async def tail() -> None:
        async for chunk in jobs.tail_job_logs(job_id):
            out.write(chunk)
            out.flush()

    try:
        asyncio.run(tail())
    except RuntimeError as exc:  # the stream closed early (head restarted): the status says what happened
        print(f"log stream closed: {exc}", file=sys.stderr)
    deadline = time.time() + 30
    while (state := status_of(address, job_id)) not in TERMINAL and time.time() < deadline:
        time.sleep(0.5)
    return state


def stop(address: str | None, job_id: str) -> bool:
    """Ask Ray to stop the job (SIGTERM to its driver, SIGKILL a few seconds later); False if it had ended."""
    try:
        return client(address).stop_job(job_id)
    except RuntimeError as exc:
        raise ClusterError(_not_found(job_id, exc)) from None


def wait(address: str | None, job_id: str, timeout_s: float | None = None, poll_s: float = 1.0) -> str:
    deadline = None if timeout_s is None else time.time() + timeout_s
    while (state := status_of(address, job_id)) not in TERMINAL:
        if deadline is not None and time.time() > deadline:
            break
        time.sleep(poll_s)
    return state


def list_jobs(address: str | None, everything: bool = False) -> list:
    jobs = client(address).list_jobs()
    if not everything:
        jobs = [j for j in jobs if (j.metadata or {}).get("specbatch") == "1"]
    return sorted(jobs, key=lambda j: j.start_time or 0)


def list_table(jobs: list) -> str:
    rows = [("SUBMISSION ID", "STATUS", "STARTED", "OUTPUT")]
    for j in jobs:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(j.start_time / 1000)) if j.start_time else "-"
        rows.append((j.submission_id or j.job_id or "-", str(getattr(j.status, "value", j.status)), started,
                     (j.metadata or {}).get("output", "-")))
    widths = [max(len(r[i]) for r in rows) for i in range(3)]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3] for r in rows)
