"""The Ray driver: plan shards, start worker actors, hand out shards, retry, resume, report.

Only shard specs (file, range) and stats rows cross between driver and workers; prompts and
completions go straight between workers and object storage.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from tqdm import tqdm

from pipeline.job_state import JobState
from pipeline.planner import plan_shards
from pipeline.report import summarize, write_report
from workers.actor import GenerationWorker
from workers.config import JobConfig
from workers.models import check_model_path
from workers.mtp_head import read_spec
from workers.shard_io import ShardSpec
from workers.storage import safe_url

log = logging.getLogger(__name__)
_WORKER_DEATHS = (RayActorError, ActorDiedError, ActorUnavailableError)


class ResourceError(RuntimeError):
    """The cluster can never satisfy the job's resource request."""


class JobFailed(RuntimeError):
    """Some shards failed every attempt; the output has no _SUCCESS."""


@dataclass(frozen=True)
class WorkerShape:
    count: int
    gpus: float
    cpus: float
    memory: int | None


def connect(address: str | None) -> None:
    """Attach to a cluster, or start a local one bound to 127.0.0.1 (Ray's ports carry no auth)."""
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True)


def worker_shape(config: JobConfig, cluster: dict[str, float]) -> WorkerShape:
    """Resolve `auto` against the cluster and fail now for requests it can never satisfy
    (a GPU actor on a GPU-less cluster would otherwise wait forever without an error)."""
    r, gpus_total, cpus_total = config.resources, cluster.get("GPU", 0.0), cluster.get("CPU", 0.0)
    gpus = (1.0 if gpus_total >= 1 else 0.0) if r.gpus_per_worker == "auto" else float(r.gpus_per_worker)
    count = (max(1, int(gpus_total // max(gpus, 1))) if gpus else 1) if r.workers == "auto" else int(r.workers)
    if gpus > gpus_total:
        raise ResourceError(f"resources.gpus_per_worker={gpus:g} but the cluster has {gpus_total:g} GPUs; "
                            "set resources.gpus_per_worker: 0 (or auto) to run on CPUs")
    if r.cpus_per_worker > cpus_total:
        raise ResourceError(f"resources.cpus_per_worker={r.cpus_per_worker:g} but the cluster has {cpus_total:g} CPUs")
    if r.memory and r.memory > cluster.get("memory", 0):
        raise ResourceError(f"resources.memory={r.memory} bytes but the cluster has {cluster.get('memory', 0):.0f}")
    return WorkerShape(count, gpus, r.cpus_per_worker, r.memory)


class WorkerPool:
    """Actors by id; a dead one is replaced by a fresh actor with a new id."""

    def __init__(self, config: JobConfig, shape: WorkerShape):
        self.config, self.shape, self.created = config, shape, 0
        options = {"num_cpus": shape.cpus, "num_gpus": shape.gpus, "scheduling_strategy": "SPREAD",
                   "max_restarts": 0, "max_task_retries": 0}
        if shape.memory:
            options["memory"] = shape.memory
        self.actor_class = ray.remote(GenerationWorker).options(**options)
        self.actors = {}
        for _ in range(shape.count):
            self.add()

    def add(self) -> str:
        worker_id = f"worker-{self.created:03d}"
        self.created += 1
        self.actors[worker_id] = self.actor_class.remote(self.config.model_dump(mode="json"), worker_id,
                                                         self.shape.cpus)
        return worker_id

    def replace(self, worker_id: str) -> str:
        ray.kill(self.actors.pop(worker_id), no_restart=True)
        return self.add()

    def shutdown(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()


def run_job(config: JobConfig, overwrite: bool = False, address: str | None = None, progress: bool = True) -> dict:
    """Run (or resume) a job to completion and return its summary."""
    started = time.time()
    for path in filter(None, (config.model.target, config.model.draft if config.model.drafter == "model" else None)):
        check_model_path(path, config.input.storage_options)
    if config.model.drafter == "mtp":
        read_spec(config.model.draft, config.input.storage_options)  # no head there: fail before any worker starts
    state = JobState(config)
    plan = plan_shards(config)
    resumed = state.claim(overwrite)
    try:
        done = state.committed() if resumed else {}
        todo = deque((spec, 1) for spec in plan.shards if spec.shard_id not in done)
        stats = [{**s, "skipped": True} for s in done.values() if s["shard_id"] in {p.shard_id for p in plan.shards}]
        if todo:
            connect(address)
            stats += _dispatch(config, state, todo, len(plan.shards), len(stats), progress)
        summary = summarize(stats, time.time() - started, len(done), safe_url(config.output.path))
        summary["skipped_files"] = [f._asdict() for f in plan.skipped_files]
        write_report(state, stats, summary)
        return summary
    finally:
        state.release()


def _dispatch(config: JobConfig, state: JobState, todo: deque, total: int, skipped: int, progress: bool) -> list[dict]:
    """Keep every actor busy with one shard at a time until the queue is empty."""
    pool = WorkerPool(config, worker_shape(config, ray.cluster_resources()))
    try:  # a worker that cannot load its models fails the job now, with the worker's own error
        devices = ray.get([actor.device.remote() for actor in pool.actors.values()])
    except _WORKER_DEATHS as exc:
        pool.shutdown()
        raise JobFailed(f"workers could not start: {exc}") from None
    log.info("workers ready on %s", ", ".join(devices))
    running: dict[ray.ObjectRef, tuple[str, ShardSpec, int]] = {}
    idle, results, failures = deque(pool.actors), [], []
    bar = tqdm(total=total, initial=skipped, unit="shard", disable=not progress, desc=config.name)
    generated, t0, last_beat = 0, time.time(), time.time()
    try:
        while todo or running:
            while todo and idle:
                worker_id = idle.popleft()
                spec, attempt = todo.popleft()
                running[pool.actors[worker_id].run_shard.remote(spec, attempt)] = (worker_id, spec, attempt)
            ready, _ = ray.wait(list(running), num_returns=1, timeout=10.0)
            if time.time() - last_beat > 30:
                state.heartbeat()
                last_beat = time.time()
            for ref in ready:
                worker_id, spec, attempt = running.pop(ref)
                try:
                    result = ray.get(ref)
                except _WORKER_DEATHS as exc:
                    log.warning("%s died running %s (attempt %d): %s", worker_id, spec.shard_id, attempt, exc)
                    idle.append(pool.replace(worker_id))
                    _retry(config, todo, failures, spec, attempt, f"worker died: {exc}")
                    continue
                except Exception as exc:  # the shard itself failed (storage down, bad file): retry elsewhere
                    log.warning("%s failed on %s (attempt %d): %s", spec.shard_id, worker_id, attempt, exc)
                    idle.append(worker_id)
                    _retry(config, todo, failures, spec, attempt, str(exc))
                    continue
                idle.append(worker_id)
                results.append(result)
                generated += result["generated_tokens"]
                bar.update(1)
                bar.set_postfix(tok_s=f"{generated / (time.time() - t0):.1f}", rows=sum(r["rows"] for r in results))
    finally:
        bar.close()
        pool.shutdown()
    if failures:
        raise JobFailed("shards failed after every attempt (no _SUCCESS written):\n" + "\n".join(failures))
    return results


def _retry(config: JobConfig, todo: deque, failures: list[str], spec: ShardSpec, attempt: int, reason: str) -> None:
    if attempt < config.retries.max_attempts:
        todo.append((spec, attempt + 1))
    else:
        failures.append(f"  {spec.shard_id} ({safe_url(spec.url)} [{spec.start}, {spec.stop})): {reason}")
