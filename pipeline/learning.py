"""The driver's side of a learning job (speculation.learn: mtp): when to distil, and handing the head out.

Once `learn_after_rows` output rows are committed, one Ray task (workers/learning.py, learn_head) distils an
MTP head from the committed shards while the workers go on generating, with a worker's resources (on CPUs:
those free, or a share of the workers' when none are). Its
result, the head's files, stays in the Ray object store; every shard handed out afterwards carries a
reference to it, and a worker switches drafters before its next shard (it fetches the files once per
version). A resumed job finds the head saved under OUTPUT/drafters/mtp/ and hands it out from its first shard.
"""
from __future__ import annotations

import json
import logging
import math
import time

import ray

from workers.actor import HeadBroadcast, learn_head_task
from workers.config import JobConfig
from workers.model_paths import HEAD_CONFIG, HEAD_REPORT, LEARNED_HEAD, read_head_files
from workers.schemas import ShardStats
from workers.storage import Store, join

log = logging.getLogger(__name__)


class Learner:
    """One job's learning: idle, distilling, or holding the head every new shard gets."""

    def __init__(self, config: JobConfig, store: Store, cpus: float, gpus: float, quiet: bool = True):
        self.config, self.cpus, self.gpus, self.quiet = config, cpus, gpus, quiet
        self.enabled = config.speculation.learn != "none"
        self.url = store.url(*LEARNED_HEAD)
        self.head: HeadBroadcast | None = None
        self.task: ray.ObjectRef | None = None
        self.launched = 0.0
        self.info: dict = {}  # the summary's "learning"
        if self.enabled and store.exists(*LEARNED_HEAD, HEAD_CONFIG):
            files = read_head_files(self.url, config.output.storage_options)
            if self._pays(files):
                self.head = HeadBroadcast(1, ray.put(files))
                self.info = {"status": "resumed with the saved head", **_report_figures(files)}
            else:
                self.info = {"status": "kept the configured drafters (the saved head does not pay)", **_report_figures(files)}

    @property
    def finishing_slice(self) -> bool:
        """A slice of a job (input.limit) waits for its distillation: the head then serves the rest of the job."""
        return self.task is not None and self.config.input.limit is not None

    @property
    def pending(self) -> list[ray.ObjectRef]:
        return [self.task] if self.task is not None else []

    def committed(self, stats: list[ShardStats]) -> None:
        """Start the distillation once enough output rows are committed (counting earlier runs' shards)."""
        rows = sum(s.rows - s.failed_rows for s in stats)
        if not self.enabled or self.head or self.task or self.info or rows < self.config.speculation.learn_after_rows:
            return
        free = ray.available_resources()
        cpus = min(self.cpus, free.get("CPU", 0.0))  # none free: the distillation shares the workers' CPUs
        if free.get("GPU", 0.0) < self.gpus:
            log.warning("learning waits for a free GPU (it asks %.3g, %.3g are free): leave room beside the workers "
                        "for the distillation", self.gpus, free.get("GPU", 0.0))
        urls = [join(self.config.output.path, "data", f"{s.shard_id}.parquet") for s in stats]
        task = ray.remote(learn_head_task).options(num_cpus=cpus, num_gpus=self.gpus, max_retries=0)
        self.task = task.remote(self.config.model_dump(mode="json"), urls, self.url, self.cpus, self.quiet)
        self.launched = time.time()
        self.info = {"status": "distilling", "after_rows": rows, "after_shards": len(stats)}
        log.info("learning: distilling an MTP head from %d committed rows", rows)

    def finished(self) -> None:
        """Take the distillation's result: the head every later shard gets, or the reason there is none."""
        ref, self.task = self.task, None
        seconds = time.time() - self.launched
        try:
            files = ray.get(ref)
        except Exception as exc:  # a failed distillation must not sink the job: it goes on with its drafters
            log.warning("learning failed; the job goes on with its configured drafters: %s", exc)
            self.info.update(status="failed", error=str(exc), distill_s=seconds)
            return
        self.info.update(head=self.url, distill_s=seconds, **_report_figures(files))
        if not self._pays(files):  # drafting with it would not speed the job up: keep the configured drafters
            self.info.update(status="kept the configured drafters (the head does not pay)")
            return
        self.head = HeadBroadcast(1, ref)
        self.info.update(status="switched")

    def _pays(self, files: dict[str, bytes]) -> bool:
        """Whether the head's expected speed-up (at least 1: k = 0 is among the choices) beats
        speculation.learn_min_speedup (unknown: yes)."""
        expected = (json.loads(files[HEAD_REPORT]).get("expected") or {}).get("speedup")
        return expected is None or expected > self.config.speculation.learn_min_speedup

    def stop(self) -> None:
        """The job ended first: stop a distillation still running."""
        if self.task is not None:
            ray.cancel(self.task, force=True)
            self.task = None
            self.info.update(status="unfinished (the job ended first)", distill_s=time.time() - self.launched)


def _report_figures(files: dict[str, bytes]) -> dict:
    """What the summary repeats from a head's training report."""
    report = json.loads(files[HEAD_REPORT])
    expected = report.get("expected") or {}
    return {"steps": report.get("steps"), "stopped": report.get("stopped"), "expected_speedup": expected.get("speedup"),
            "expected_k": expected.get("k"), "train_sequences": report.get("workload", {}).get("train_sequences"),
            "heldout_accept_by_position": [round(a, 3) for a in report.get("heldout_accept_by_position", [])
                                           if not math.isnan(a)]}  # nan: no draft reached that position
