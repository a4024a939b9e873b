"""Counters of one generate() call; they become the shard statistics."""
from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass
class GenerationStats:
    max_k: int
    prompt_tokens: int = 0
    prefilled_tokens: int = 0       # prompt tokens computed; the rest were copied from a shared prefix
    generated_tokens: int = 0
    target_passes: int = 0
    row_passes: int = 0             # rows summed over target passes: tokens per row per pass = generated / this
    draft_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    controller_s: float = 0.0       # in the controller: choosing offers and the draft stop, observing each step
    other_s: float = 0.0            # the rest of generate()'s wall time: accepting, retiring, stop checks, planning
    attempted_by_position: np.ndarray = field(init=False)
    accepted_by_position: np.ndarray = field(init=False)
    k_hist: np.ndarray = field(init=False)

    def __post_init__(self):
        self.attempted_by_position = np.zeros(self.max_k, dtype=np.int64)
        self.accepted_by_position = np.zeros(self.max_k, dtype=np.int64)
        self.k_hist = np.zeros(self.max_k + 1, dtype=np.int64)

    def record(self, k: int, draft_lens: list[int], accepted: list[int]) -> None:
        """One verify pass: its k (the longest draft it verified), and per row the drafts it verified and accepted."""
        self.target_passes += 1
        self.row_passes += len(accepted)
        self.k_hist[k] += 1
        for drafted, acc in zip(draft_lens, accepted):
            self.drafted_tokens += drafted
            self.accepted_tokens += acc
            tried = min(drafted, acc + 1)
            self.attempted_by_position[:tried] += 1
            self.accepted_by_position[:acc] += 1

    @property
    def accept_by_position(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.accepted_by_position, self.attempted_by_position)]
