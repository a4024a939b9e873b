"""The Ray actor: loads the models once, then runs whatever shards the driver hands it.

torch and the engine are imported when the actor starts, not when this module is imported: the driver
names this class to Ray and must start without them.
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

import ray

from workers.config import JobConfig
from workers.schemas import ShardStats
from workers.shard_io import ShardSpec

if TYPE_CHECKING:
    from workers.verify_sample import RowCheck


class GenerationWorker:
    """Plain class; the driver wraps it with ray.remote and explicit resources."""

    def __init__(self, config: dict, worker_id: str, cpus: float):
        import torch

        from workers.shard_runner import ShardRunner

        torch.set_num_threads(max(1, math.ceil(cpus)))  # cpus_per_worker is this worker's torch thread count
        node = ray.get_runtime_context().get_node_id() if ray.is_initialized() else None
        self.runner = ShardRunner(JobConfig.model_validate(config), worker_id, ray_node_id=node)

    def run_shard(self, spec: ShardSpec, attempt: int, run_id: str) -> ShardStats:
        return self.runner.run(spec, attempt, run_id)

    def verify(self, spec: ShardSpec, picks: list[int]) -> list[RowCheck]:
        return self.runner.verify(spec, picks)

    def device(self) -> str:
        return str(self.runner.device)
