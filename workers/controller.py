"""Choosing the draft length k from measured acceptance and measured cost.

Expected tokens per verify pass for a row with per-position acceptance a_1..a_k is
E(k) = 1 + sum_{j<=k} prod_{i<=j} a_i (Leviathan et al. 2023). The batch's k maximises
sum_rows E_row(k) / (k * t_draft(n) + t_verify(n, k + 1)), with costs learnt online. k = 0 is plain
decoding and wins whenever drafting does not pay. The batch shares one k because a verify pass
costs its widest row anyway; per-row acceptance decides how much that width is worth.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Protocol

import numpy as np

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one decoding step did, as the generator saw it."""
    k: int                      # draft length offered to every row
    offered: np.ndarray         # (n,) positions offered per row: min(k, row's remaining budget)
    accepted: np.ndarray        # (n,) drafts accepted per row
    width: int                  # tokens per row in the verify pass (1 + longest draft)
    draft_s: float
    verify_s: float


class Controller(Protocol):
    def choose(self, n_rows: int) -> int: ...
    def observe(self, step: StepRecord) -> None: ...
    def admit(self, start: int, count: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...


class FixedK:
    def __init__(self, k: int):
        self.k = k

    def choose(self, n_rows: int) -> int:
        return self.k

    def observe(self, step: StepRecord) -> None: ...
    def admit(self, start: int, count: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...


def expected_tokens(alpha: np.ndarray, k: int) -> np.ndarray:
    """E(k) per row for per-position acceptance `alpha` (rows, max_k)."""
    return 1.0 + np.cumprod(alpha[:, :k], axis=1).sum(axis=1)


class CostModel:
    """Verify time t(n, w) = a + b*n + c*n*w fitted by least squares on measured cell means; draft time
    per drafted position as a running mean. Replaceable by a test with any object of the same shape."""

    def __init__(self):
        self.cells: dict[tuple[int, int], tuple[float, int]] = {}
        self.coef = np.array([1.0, 0.0, 0.1])
        self.draft_per_token = 0.0

    def observe(self, n: int, width: int, verify_s: float, k: int, draft_s: float) -> None:
        mean, count = self.cells.get((n, width), (0.0, 0))
        weight = 1.0 / min(count + 1, 20)  # a running mean that keeps adapting to the machine
        self.cells[(n, width)] = (mean + weight * (verify_s - mean), count + 1)
        if k:
            self.draft_per_token += 0.1 * (draft_s / k - self.draft_per_token)
        if len({w for _, w in self.cells}) > 1 or len(self.cells) > 2:
            keys = list(self.cells)
            x = np.array([[1.0, n, n * w] for n, w in keys])
            y = np.array([self.cells[key][0] for key in keys])
            sw = np.sqrt([min(self.cells[key][1], 20) for key in keys])
            coef, *_ = np.linalg.lstsq(x * sw[:, None], y * sw, rcond=None)
            self.coef = np.maximum(coef, [1e-6, 0.0, 1e-9])

    def verify(self, n: int, width: int) -> float:
        return float(self.coef @ [1.0, n, n * width])

    def draft(self, n: int, k: int) -> float:
        return self.draft_per_token * k


class AdaptiveK:
    """Per-row acceptance (EWMA per position) and online costs -> the k with the most tokens per second.

    Hysteresis keeps k unless another value is predicted `margin` better; every `explore_every` steps
    it tries one position more than it would, so acceptance where it stopped drafting (k = 0 included)
    is measured again and speculation can come back. Row acceptance moves at `row_rate` 0.1 (about ten
    observations): at 0.3 an EWMA of 0/1 hits has a standard deviation near 0.2, far above the margin, and
    at batch 1 k flapped over 0..5 on stationary input (about 50 switches per 1000 steps).
    """

    def __init__(self, max_k: int, max_rows: int, costs: CostModel | None = None, prior: float = 0.6,
                 row_rate: float = 0.1, worker_rate: float = 0.05, margin: float = 0.03, explore_every: int = 16):
        self.max_k, self.costs = max_k, costs or CostModel()
        self.worker_alpha = np.full(max_k, prior)
        self.row_alpha = np.tile(self.worker_alpha, (max_rows, 1))
        self.row_rate, self.worker_rate, self.margin, self.explore_every = row_rate, worker_rate, margin, explore_every
        self.k, self.steps = max_k, 0

    def rate(self, n_rows: int, k: int) -> float:
        """Predicted generated tokens per second for the first n rows at draft length k."""
        gain = expected_tokens(self.row_alpha[:n_rows], k).sum()
        return gain / (self.costs.draft(n_rows, k) + self.costs.verify(n_rows, k + 1))

    def choose(self, n_rows: int) -> int:
        self.steps += 1
        if self.max_k == 0:
            return 0
        rates = np.array([self.rate(n_rows, k) for k in range(self.max_k + 1)])
        best = int(rates.argmax())
        if rates[best] > rates[self.k] * (1 + self.margin):
            self.k = best
        chosen = min(self.k + 1, self.max_k) if self.steps % self.explore_every == 0 else self.k
        # Costs are logged through the cost model's interface only, so any object of its shape can be injected.
        log.debug("alpha=%s verify(n, k+1)=%.3gs draft(n, k)=%.3gs rates=%s -> k=%d",
                  np.round(self.worker_alpha, 2), self.costs.verify(n_rows, chosen + 1),
                  self.costs.draft(n_rows, chosen), np.round(rates, 1), chosen)
        return chosen

    def observe(self, step: StepRecord) -> None:
        n = len(step.offered)
        self.costs.observe(n, step.width, step.verify_s, step.k, step.draft_s)
        for row in range(n):
            tried = min(int(step.offered[row]), int(step.accepted[row]) + 1)
            if tried == 0:
                continue
            hits = (np.arange(tried) < step.accepted[row]).astype(float)
            self.row_alpha[row, :tried] += self.row_rate * (hits - self.row_alpha[row, :tried])
            self.worker_alpha[:tried] += self.worker_rate * (hits - self.worker_alpha[:tried])

    def admit(self, start: int, count: int) -> None:
        self.row_alpha[start : start + count] = self.worker_alpha

    def move(self, src: int, dst: int) -> None:
        self.row_alpha[dst] = self.row_alpha[src]
