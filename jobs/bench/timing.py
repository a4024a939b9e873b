"""Wall time of work on a device: CUDA runs asynchronously, so the clock stops only once the device is idle."""
from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

import torch

T = TypeVar("T")


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def timed(device: torch.device, work: Callable[[], T]) -> tuple[T, float]:
    """(work's result, seconds it took on `device`)."""
    sync(device)
    started = time.perf_counter()
    result = work()
    sync(device)
    return result, time.perf_counter() - started
