"""What an output folder says about the job that writes it: _job.json, the live-job lease, committed shards.

Resume reads this state: a shard is committed when both its data file and its stats part exist
(the worker writes data first), so a shard interrupted between the two simply runs again and
rewrites the same key.
"""
from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
import time
import uuid
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from workers.config import JobConfig, redacted
from workers.schemas import ShardStats
from workers.storage import Store, read_bytes

LEASE, MANIFEST = "_LEASE.json", "_job.json"
# What a run writes besides the lease; --overwrite removes it all.
OUTPUTS = ("data", "stats", "summary.json", "errors.parquet", "report.html", "_SUCCESS", MANIFEST)
# A live driver rewrites its lease every HEARTBEAT_S; a lease older than LEASE_TTL_S belongs to a dead one.
HEARTBEAT_S = 30.0
LEASE_TTL_S = 120.0
# Sections and keys that change how a job runs but not what it writes: resume ignores them.
_RUN_ONLY_SECTIONS = ("resources", "retries")
_RUN_ONLY_KEYS = ("storage_options", "max_failed_rows", "step", "limit")  # model.step: how passes run;
                                                                            # input.limit: which rows run now
# What drafts, and how far: lossless speculation never changes a token it writes, so these are run-only too
# wherever the output is provably drafter-invariant (see drafter_invariant).
DRAFTER_KEYS = ("model.drafter", "model.draft", "speculation.k", "speculation.max_k", "speculation.ngram_size",
                "speculation.suffix_max_tokens", "speculation.learn", "speculation.learn_after_rows",
                "speculation.learn_minutes", "speculation.learn_min_speedup")


class OutputConflict(RuntimeError):
    """The output path belongs to another job (or a different config of this one)."""


def installed_version(name: str) -> str:
    """A distribution's version; specbatch itself may run uninstalled (code shipped by `submit`)."""
    try:
        return version(name)
    except PackageNotFoundError:
        return "not installed"


def versions() -> dict[str, str]:
    """Library versions for _job.json."""
    names = ("torch", "transformers", "ray", "pyarrow", "fsspec", "specbatch")
    return {"python": sys.version.split()[0], **{n: installed_version(n) for n in names}}


class JobState:
    """One run's view of its output folder: claims it, keeps the lease fresh, lists what is committed."""

    def __init__(self, config: JobConfig):
        self.config = config
        self.store = Store(config.output.path, config.output.storage_options)
        self.run_id = uuid.uuid4().hex[:12]
        self.started = time.time()
        self.last_beat = 0.0
        self.changes: list[str] = []  # run-only settings this run changed against the output's previous runs

    def check(self, overwrite: bool) -> dict | None:
        """The output's manifest (None for a fresh path), after refusing a path that a live job holds
        (fresh lease) or that holds another config's output (unless `overwrite`)."""
        lease = self.store.read_json(LEASE)
        if lease and lease_alive(lease):
            raise OutputConflict(f"{self.store.root} is being written by a live job (run {lease['run_id']} on "
                                 f"{lease['host']}, last seen {time.time() - lease['heartbeat']:.0f}s ago)")
        manifest = self.store.read_json(MANIFEST)
        if manifest and manifest["fingerprint"] != fingerprint(self.config):
            if not overwrite:
                changed = changed_keys(manifest["config"], redacted(self.config))
                raise OutputConflict(f"{self.store.root} holds the output of a different config (changed: "
                                     f"{', '.join(changed) or 'unknown'}); use another output path or --overwrite")
        return manifest

    def claim(self, overwrite: bool, planned_shards: int) -> bool:
        """Take the output path for this run (see check; `overwrite` clears another config's output first);
        returns whether a previous run's shards may be resumed."""
        manifest = self.check(overwrite)
        if overwrite and manifest:
            for part in OUTPUTS:
                self.store.delete(part)
            manifest = None
        self.changes = run_only_changes(manifest["config"], redacted(self.config)) if manifest else []
        self.remove_partials()
        self.heartbeat()
        self.store.write_json({"name": self.config.name, "fingerprint": fingerprint(self.config),
                               "config": redacted(self.config), "versions": versions(),
                               "started": (manifest or {}).get("started", self.started), "run_id": self.run_id,
                               "run_started": self.started, "shards_planned": planned_shards}, MANIFEST)
        return manifest is not None

    def remove_partials(self) -> None:
        """Delete temporary files a killed run left behind (local writes only: an object PUT is never partial)."""
        def sweep(fs, path: str) -> None:
            if fs.exists(path):
                for leftover in [p for p in fs.find(path) if p.rsplit("/", 1)[-1].startswith(".") and p.endswith(".tmp")]:
                    fs.rm(leftover)

        self.store.apply(sweep, "clean")

    def heartbeat(self) -> None:
        self.store.write_json({"run_id": self.run_id, "host": platform.node(), "pid": os.getpid(),
                               "heartbeat": time.time()}, LEASE)
        self.last_beat = time.time()

    def heartbeat_if_due(self) -> None:
        if time.time() - self.last_beat >= HEARTBEAT_S:
            self.heartbeat()

    def release(self) -> None:
        self.store.delete(LEASE)

    def record_retry(self, shard_id: str, attempt: int, worker_id: str, reason: str) -> None:
        """Keep a failed attempt for the report (one file each: runs add to them, never rewrite)."""
        self.store.write_json({"shard_id": shard_id, "attempt": attempt, "worker_id": worker_id, "reason": reason,
                               "at": time.time(), "run_id": self.run_id},
                              "stats", "retries", f"{shard_id}-attempt{attempt}-{self.run_id}.json")

    def committed(self) -> dict[str, ShardStats]:
        return committed_shards(self.store)


def committed_shards(store: Store) -> dict[str, ShardStats]:
    """Stats of every committed shard (data file and stats part both present), by shard id."""
    data = {u.rsplit("/", 1)[-1].removesuffix(".parquet") for u in store.list("data", suffixes=[".parquet"])}
    parts = {}
    for url in store.list("stats", "parts", suffixes=[".json"]):
        shard_id = url.rsplit("/", 1)[-1].removesuffix(".json")
        if shard_id in data:
            parts[shard_id] = ShardStats.from_dict(json.loads(read_bytes(url, store.options)))
    return parts


def read_manifest(store: Store) -> dict:
    """The output's _job.json; FileNotFoundError when the folder holds no job."""
    manifest = store.read_json(MANIFEST)
    if manifest is None:
        raise FileNotFoundError(f"{store.root} holds no specbatch job (no {MANIFEST})")
    return manifest


def job_status(store: Store) -> str:
    """finished (_SUCCESS written), running (a live lease) or incomplete (stopped, crashed or failed)."""
    if store.exists("_SUCCESS"):
        return "finished"
    lease = store.read_json(LEASE)
    return "running" if lease and lease_alive(lease) else "incomplete"


def lease_alive(lease: dict) -> bool:
    """A lease holds while its heartbeat is fresh, unless its driver ran on this host and is gone
    (a killed driver must not block the rerun that resumes it)."""
    if time.time() - lease["heartbeat"] >= LEASE_TTL_S:
        return False
    if lease.get("host") == platform.node() and lease.get("pid"):
        try:
            os.kill(lease["pid"], 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    return True


def drafter_invariant(config_dict: dict[str, Any]) -> bool:
    """Whether the job's tokens are the same whatever drafts them: greedy decoding, or sampling where every
    drafter's proposal is checked against the target's own draw (deterministic drafters; every drafter under
    `speculation.sampling: invariant`). Textbook rejection sampling from a model drafter's q is not."""
    g, s, m = (config_dict.get(section, {}) for section in ("generation", "speculation", "model"))
    drafter = m.get("drafter", [])
    models = {"model", "mtp"} & set(drafter if isinstance(drafter, list) else [drafter]) or s.get("learn") == "mtp"
    greedy = g.get("temperature", 0) == 0 or g.get("top_k") == 1
    return greedy or s.get("sampling", "rejection") == "invariant" or not models


def _output_fields(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The parts of a (redacted) config dict that determine the job's output."""
    invariant = drafter_invariant(config_dict)

    def strip(node: Any, path: str) -> Any:
        if isinstance(node, dict):
            return {k: strip(v, f"{path}{k}.") for k, v in node.items()
                    if k not in _RUN_ONLY_KEYS and not (invariant and f"{path}{k}" in DRAFTER_KEYS)}
        return node

    return {k: strip(v, f"{k}.") for k, v in config_dict.items() if k not in _RUN_ONLY_SECTIONS}


def run_only_changes(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """"key: old -> new" for every drafter or run-only setting a resumed job changed (its output cannot show it)."""
    def leaves(node: Any, path: str = "") -> dict[str, Any]:
        if isinstance(node, dict):
            return {k: v for key, child in node.items() for k, v in leaves(child, f"{path}{key}.").items()}
        return {path.rstrip("."): node}

    before, after = leaves(old), leaves(new)
    return [f"{key}: {before.get(key)!r} -> {after.get(key)!r}" for key in sorted(before.keys() | after.keys())
            if before.get(key) != after.get(key) and key.split(".", 1)[0] != "output"]


def fingerprint(config: JobConfig) -> str:
    """sha256 of the canonical JSON of everything that affects the output; resume refuses a change."""
    canonical = json.dumps(_output_fields(redacted(config)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted paths of the output-affecting keys that differ between two redacted config dicts."""
    return _diff(_output_fields(old), _output_fields(new), "")


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = []
        for key in sorted(old.keys() | new.keys()):
            path = f"{prefix}.{key}" if prefix else key
            if key not in old or key not in new:
                changed.append(path)
            else:
                changed += _diff(old[key], new[key], path)
        return changed
    return [] if old == new else [prefix]
