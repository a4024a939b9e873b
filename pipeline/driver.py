"""The Ray driver: plan shards, start worker actors, hand out shards, retry, resume, report.

Only shard specs (file, range) and stats rows cross between driver and workers; prompts and
completions go straight between workers and object storage.
"""
from __future__ import annotations

import itertools
import logging
import os
import time
from collections import deque
from dataclasses import dataclass

import ray
from ray.exceptions import ActorDiedError, ActorUnavailableError, RayActorError
from tqdm import tqdm

from pipeline.corpus_sharing import SharedCorpus
from pipeline.job_state import HEARTBEAT_S, JobState
from pipeline.learning import Learner
from pipeline.noise import MachineLoad, cpu_times
from pipeline.planner import Plan, plan_job
from pipeline.report import write_report
from pipeline.summary import RunInfo, summarize, write_closing_files
from workers.actor import GenerationWorker
from workers.config import JobConfig
from workers.schemas import ShardStats
from workers.shard_io import ShardSpec
from workers.storage import safe_url
from workers.verify_sample import RowCheck, pick_rows, summarize_checks

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


def connect(address: str | None, verbose: bool = False) -> None:
    """Attach to the cluster at `address`, or start a private local one.

    Without an address Ray would attach to whatever /tmp/ray/ray_current_cluster names (a live or
    long-dead `ray start`), so a local run always asks for a new instance; attaching is --address's job.
    """
    if ray.is_initialized():
        return
    if address:
        ray.init(address=address, log_to_driver=True, logging_level=logging.INFO if verbose else logging.WARNING)
        return
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    os.environ.setdefault("RAY_AUTH_MODE", "disabled")  # a private cluster for this process: no token to set up
    ray.init(address="local", num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=True,
             logging_level=logging.INFO if verbose else logging.WARNING)


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

    def __init__(self, config: JobConfig, shape: WorkerShape, verbose: bool = False):
        self.config, self.shape, self.created = config, shape, 0
        self.quiet = not verbose   # no progress bars from the workers (model conversion, "Loading weights", ...)
        options = {"num_cpus": shape.cpus, "num_gpus": shape.gpus, "scheduling_strategy": "SPREAD",
                   "max_restarts": 0, "max_task_retries": 0}
        if shape.memory:
            options["memory"] = shape.memory
        self.actor_class = ray.remote(GenerationWorker).options(**options)
        self.actors = {}
        for _ in range(shape.count):
            self.add()

    @classmethod
    def ready(cls, config: JobConfig, verbose: bool = False) -> WorkerPool:
        """A pool shaped for the connected cluster whose workers have loaded their models; a worker that cannot
        fails the job now, with the worker's own error."""
        pool = cls(config, worker_shape(config, ray.cluster_resources()), verbose)
        try:
            devices = ray.get([actor.device.remote() for actor in pool.actors.values()])
        except _WORKER_DEATHS as exc:
            pool.shutdown()
            raise JobFailed(f"workers could not start: {exc}") from None
        log.info("workers ready on %s", ", ".join(devices))
        return pool

    def add(self) -> str:
        worker_id = f"worker-{self.created:03d}"
        self.created += 1
        self.actors[worker_id] = self.actor_class.remote(self.config.model_dump(mode="json"), worker_id,
                                                         self.shape.cpus, self.quiet)
        return worker_id

    def replace(self, worker_id: str) -> str:
        ray.kill(self.actors.pop(worker_id), no_restart=True)
        return self.add()

    def shutdown(self) -> None:
        for actor in self.actors.values():
            ray.kill(actor, no_restart=True)
        self.actors.clear()


def run_job(config: JobConfig, overwrite: bool = False, address: str | None = None, progress: bool = True,
            plan: Plan | None = None, verbose: bool = False, verify_sample: int = 0) -> dict:
    """Run (or resume) a job to completion and return its summary; `plan` is plan_job(config), made here if
    not given. `verify_sample`: rows to regenerate without speculation and compare (summary's verify_sample)."""
    plan = plan or plan_job(config)
    cpu_at_start = cpu_times()
    state = JobState(config)
    resumed = state.claim(overwrite, len(plan.shards))
    try:
        planned = {spec.shard_id: spec for spec in plan.shards}
        done = {k: s for k, s in state.committed().items() if k in planned and s.covers(planned[k])} if resumed else {}
        todo = deque((spec, 1) for spec in plan.shards if spec.shard_id not in done)
        stats, checks, learning = list(done.values()), None, {}
        if todo or verify_sample:
            connect(address, verbose)
            pool = WorkerPool.ready(config, verbose)
            try:
                if todo:
                    learner = Learner(config, state.store, pool.shape.cpus, pool.shape.gpus, pool.quiet)
                    try:
                        stats += _dispatch(config, pool, state, todo, stats, len(plan.shards), progress, learner)
                    finally:
                        learner.stop()
                    learning = learner.info
                if verify_sample:
                    checks = _verify(pool, planned, pick_rows(stats, verify_sample, config.generation.seed))
            except JobFailed:
                write_report(state.store)  # what did commit, and every failed attempt
                raise
            finally:
                pool.shutdown()
        run = RunInfo(state.run_id, state.started, time.time() - state.started, len(plan.shards) - len(done),
                      MachineLoad.since(cpu_at_start))
        summary = summarize(stats, run, safe_url(config.output.path))
        summary["skipped_files"] = [f._asdict() for f in plan.skipped_files]
        if state.changes:
            summary["resumed_with_changes"] = state.changes
        if learning:
            summary["learning"] = learning
        if checks is not None:
            summary["verify_sample"] = summarize_checks(checks)
        write_closing_files(state.store, stats, summary)
        write_report(state.store, stats)
        return summary
    finally:
        state.release()


def _dispatch(config: JobConfig, pool: WorkerPool, state: JobState, todo: deque, earlier: list[ShardStats],
              total: int, progress: bool, learner: Learner) -> list[ShardStats]:
    """Keep every actor busy with one shard at a time until the queue is empty; each shard carries the job's
    learnt head (once there is one) and the other workers' newly committed shards for its suffix index."""
    running: dict[ray.ObjectRef, tuple[str, ShardSpec, int]] = {}
    idle, results, failures = deque(pool.actors), [], []
    corpus = SharedCorpus(config, earlier)
    bar = tqdm(total=total, initial=len(earlier), unit="shard", disable=not progress, desc=f"{config.name} shards")
    generated, t0 = 0, time.time()
    try:
        while todo or running or learner.finishing_slice:
            while todo and idle:
                worker_id = idle.popleft()
                spec, attempt = todo.popleft()
                ref = pool.actors[worker_id].run_shard.remote(spec, attempt, state.run_id, learner.head,
                                                             corpus.unread(worker_id))
                running[ref] = (worker_id, spec, attempt)
            ready, _ = ray.wait(list(running) + learner.pending, num_returns=1, timeout=HEARTBEAT_S / 3)
            state.heartbeat_if_due()
            for ref in ready:
                if ref not in running:
                    learner.finished()
                    continue
                worker_id, spec, attempt = running.pop(ref)
                try:
                    result: ShardStats = ray.get(ref)
                except _WORKER_DEATHS as exc:
                    log.warning("%s died running %s (attempt %d): %s", worker_id, spec.shard_id, attempt, exc)
                    idle.append(pool.replace(worker_id))
                    _retry(config, state, todo, failures, spec, attempt, worker_id, f"worker died: {exc}")
                    continue
                except Exception as exc:  # the shard itself failed (storage down, bad file): retry elsewhere
                    log.warning("%s failed on %s (attempt %d): %s", spec.shard_id, worker_id, attempt, exc)
                    idle.append(worker_id)
                    _retry(config, state, todo, failures, spec, attempt, worker_id, str(exc))
                    continue
                idle.append(worker_id)
                results.append(result)
                corpus.commit(result)
                learner.committed(earlier + results)
                generated += result.generated_tokens
                bar.update(1)
                bar.set_postfix_str(progress_note(sum(r.rows for r in results), generated, time.time() - t0))
    finally:
        bar.close()
    if failures:
        raise JobFailed("shards failed after every attempt (no _SUCCESS written):\n" + "\n".join(failures))
    return results


def progress_note(rows_out: int, tokens: int, seconds: float) -> str:
    """The bar counts shards (sharding.rows_per_shard input rows each); its note counts output rows (input rows x
    generation.samples_per_prompt) and this run's tokens per second."""
    return f"{rows_out} rows out, {tokens / seconds if seconds else 0.0:.1f} tokens/s"


def _verify(pool: WorkerPool, specs: dict[str, ShardSpec], picks: dict[str, list[int]]) -> list[RowCheck]:
    """Each picked shard's rows regenerated without speculation on the workers, shards spread over them."""
    actors = itertools.cycle(pool.actors.values())
    refs = [next(actors).verify.remote(specs[shard_id], rows) for shard_id, rows in picks.items()]
    try:
        return [check for checks in ray.get(refs) for check in checks]
    except _WORKER_DEATHS as exc:
        raise JobFailed(f"--verify-sample could not finish: a worker died: {exc}") from None


def _retry(config: JobConfig, state: JobState, todo: deque, failures: list[str], spec: ShardSpec, attempt: int,
           worker_id: str, reason: str) -> None:
    state.record_retry(spec.shard_id, attempt, worker_id, reason)
    if attempt < config.retries.max_attempts:
        todo.append((spec, attempt + 1))
    else:
        failures.append(f"  {spec.shard_id} ({safe_url(spec.url)} [{spec.start}, {spec.stop})): {reason}")
