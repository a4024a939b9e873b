"""The Ray actor: loads the models once, then runs whatever shards the driver hands it."""
from __future__ import annotations

import math

import torch

from workers.config import JobConfig
from workers.schemas import ShardStats
from workers.shard_io import ShardSpec
from workers.shard_runner import ShardRunner
from workers.verify_sample import RowCheck


class GenerationWorker:
    """Plain class; the driver wraps it with ray.remote and explicit resources."""

    def __init__(self, config: dict, worker_id: str, cpus: float):
        torch.set_num_threads(max(1, math.ceil(cpus)))  # cpus_per_worker is this worker's torch thread count
        self.runner = ShardRunner(JobConfig.model_validate(config), worker_id)

    def run_shard(self, spec: ShardSpec, attempt: int, run_id: str) -> ShardStats:
        return self.runner.run(spec, attempt, run_id)

    def verify(self, spec: ShardSpec, picks: list[int]) -> list[RowCheck]:
        return self.runner.verify(spec, picks)

    def device(self) -> str:
        return str(self.runner.device)
