"""What the adaptive controller costs per decoding step: `python -m jobs.bench.controller_cost`.

Times AdaptiveK's choose + draft_stop + observe (what the generator counts as `controller_s`) on synthetic
steps at batch 1, 4 and 16, max_k 8, with the real CostModel learning a CPU-like verify cost. Rows switch
between copying (long accepted drafts) and chat (short, mostly rejected ones), so the offers keep
changing as they do in a job. Only the controller's calls are timed, in CPU seconds of this thread, and
the figure is the best of several blocks of steps (as timeit reports): other work on a shared machine
only ever adds to a block.
"""
from __future__ import annotations

import argparse
import os
import time

import numpy as np

from workers.engine.controller import AdaptiveK, StepRecord
from workers.engine.drafter import COPY_PRIOR

COPY, CHAT = (0.95, 0.9), (0.5, 0.3)   # (goes on, accepted) per position


def _record(rng: np.random.Generator, offered: np.ndarray, copying: np.ndarray, max_k: int) -> StepRecord:
    """A step of a simulated drafter: each row's draft and acceptance stop at a geometric position."""
    goes_on = np.where(copying, COPY[0], CHAT[0])[:, None]
    accept = np.where(copying, COPY[1], CHAT[1])[:, None]
    position = np.arange(max_k)
    drafted = (np.cumprod(rng.random((len(offered), max_k)) < goes_on, 1) * (position < offered[:, None])).sum(1)
    accepted = (np.cumprod(rng.random((len(offered), max_k)) < accept, 1) * (position < drafted[:, None])).sum(1)
    width = int(drafted.max()) + 1
    return StepRecord(offered, drafted, accepted, width, 2e-4 * (width - 1), 0.03 + 0.002 * len(offered) * width)


def ms_per_step(batch: int, steps: int = 300, blocks: int = 7, max_k: int = 8, seed: int = 0) -> float:
    """Milliseconds of choose + draft_stop + observe per step: the best block's mean, after a block untimed."""
    rng = np.random.default_rng(seed)
    controller = AdaptiveK(max_k, batch, prior=COPY_PRIOR)
    copying = rng.random(batch) < 0.3
    means = []
    for block in range(blocks + 1):
        spent = 0.0
        for t in range(steps):
            if t % 50 == 0:                      # rows change phase now and then
                copying = rng.random(batch) < 0.3
            started = time.thread_time()
            offered = controller.choose(batch)
            controller.draft_stop()
            chosen = time.thread_time()
            tried = offered if offered.any() else np.ones(batch, dtype=int)   # the free shadow guesses
            step = _record(rng, tried, copying, max_k)
            observing = time.thread_time()
            controller.observe(step)
            spent += chosen - started + time.thread_time() - observing
        means.append(1e3 * spent / steps)
    return min(means[1:])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300, help="steps per block (7 blocks per batch size)")
    args = parser.parse_args(argv)
    print(f"load average {os.getloadavg()[0]:.2f}; AdaptiveK, max_k 8; CPU ms per step, "
          f"best of 7 blocks of {args.steps} steps")
    for batch in (1, 4, 16):
        print(f"batch {batch:>2}: {ms_per_step(batch, args.steps):.3f} ms per step")


if __name__ == "__main__":
    main()
