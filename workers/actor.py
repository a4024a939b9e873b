"""The Ray actor: loads the models once, then runs whatever shards the driver hands it.

torch and the engine are imported when the actor starts, not when this module is imported: the driver
names this class to Ray and must start without them.
"""
from __future__ import annotations

import math
import os
import sys
from typing import TYPE_CHECKING, NamedTuple

import ray

from workers.config import JobConfig
from workers.schemas import ShardStats
from workers.shard_io import ShardSpec

if TYPE_CHECKING:
    from workers.verify_sample import RowCheck


class HeadBroadcast(NamedTuple):
    """A learnt head as the driver hands it out: a version, and a reference to its files in the object store
    (inside this tuple Ray passes the reference, not the value: a worker fetches the files once per version)."""
    version: int
    files: ray.ObjectRef


def quiet_worker() -> None:
    """No progress bars and no info logs from transformers or the hub in this worker process: Ray forwards every
    redraw of a bar as a new line. Set here rather than through a runtime_env, which would keep the actor out of
    the worker processes Ray has already started (about 0.6 s of start-up)."""
    os.environ.update(HF_HUB_DISABLE_PROGRESS_BARS="1", TRANSFORMERS_VERBOSITY="error")  # read when it is imported
    if "transformers" in sys.modules:  # a worker that loads only safetensors never imports it (workers/models.py)
        import transformers

        transformers.utils.logging.disable_progress_bar()
        transformers.utils.logging.set_verbosity_error()


class GenerationWorker:
    """Plain class; the driver wraps it with ray.remote and explicit resources. `quiet`: see quiet_worker."""

    def __init__(self, config: dict, worker_id: str, cpus: float, quiet: bool = True):
        if quiet:
            quiet_worker()
        import torch

        from workers.shard_runner import ShardRunner

        torch.set_num_threads(max(1, math.ceil(cpus)))  # cpus_per_worker is this worker's torch thread count
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.runner = ShardRunner(JobConfig.model_validate(config), worker_id, ray_node_id=node)
        self.head_version = 0

    def run_shard(self, spec: ShardSpec, attempt: int, run_id: str, head: HeadBroadcast | None = None,
                  completions: tuple[str, ...] = ()) -> ShardStats:
        """Run a shard; first switch to a newer learnt head and index other workers' new completions."""
        if head is not None and head.version != self.head_version:
            self.runner.use_head(ray.get(head.files))
            self.head_version = head.version
        self.runner.read_completions(list(completions))
        return self.runner.run(spec, attempt, run_id)

    def verify(self, spec: ShardSpec, picks: list[int]) -> list[RowCheck]:
        return self.runner.verify(spec, picks)

    def device(self) -> str:
        return str(self.runner.device)


def learn_head_task(config: dict, data_urls: list[str], out_url: str, cpus: float, quiet: bool = True) -> dict[str, bytes]:
    """The learning job's Ray task (workers/learning.py); torch loads in the task's process, not the driver's."""
    if quiet:
        quiet_worker()
    from workers.learning import learn_head

    return learn_head(config, data_urls, out_url, cpus)
