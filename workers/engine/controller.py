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


class Controller:
    """Base class: `choose` the draft length for the next step; the hooks feed it what happened and keep
    per-slot state in step with the live batch (no-ops here)."""

    def choose(self, n_rows: int) -> int:
        raise NotImplementedError

    def observe(self, step: StepRecord) -> None:
        """What the step that used the chosen k did."""

    def admit(self, start: int, count: int) -> None:
        """`count` new rows enter slots start.."""

    def move(self, src: int, dst: int) -> None:
        """The row in slot `src` now lives in slot `dst`."""


class FixedK(Controller):
    def __init__(self, k: int):
        self.k = k

    def choose(self, n_rows: int) -> int:
        return self.k


def expected_tokens(alpha: np.ndarray, k: int) -> np.ndarray:
    """E(k) per row for per-position acceptance `alpha` (rows, max_k)."""
    return 1.0 + np.cumprod(alpha[:, :k], axis=1).sum(axis=1)


class CostModel:
    """Verify time by (rows, width) from measured cell means, interpolated between measured widths and
    extended past them along the last measured slope; a least-squares fit t = a + b*n + c*n*w covers
    row counts not measured yet. Draft time per drafted position is a running mean. A test may inject
    any object with the same observe / verify / draft methods."""

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
        measured = sorted((w, t) for (rows, w), (t, _) in self.cells.items() if rows == n)
        if not measured:
            return float(self.coef @ [1.0, n, n * width])
        widths, times = np.array([w for w, _ in measured], float), np.array([t for _, t in measured])
        if len(measured) == 1:
            slope = self.coef[2] * n
        else:
            end = -1 if width >= widths[-1] else 1
            pair = slice(-2, None) if end == -1 else slice(0, 2)
            slope = max(0.0, float(np.diff(times[pair])[0] / np.diff(widths[pair])[0]))
        if widths[0] <= width <= widths[-1]:
            return float(np.interp(width, widths, times))
        anchor = -1 if width > widths[-1] else 0
        return max(1e-9, float(times[anchor] + slope * (width - widths[anchor])))

    def draft(self, n: int, k: int) -> float:
        return self.draft_per_token * k


class AdaptiveK(Controller):
    """Per-row acceptance per position and online costs -> the k with the most tokens per second.

    Acceptance is counted, not averaged: decayed hits / tries per position over a prior worth a few
    tries. It learns from the first few steps of a row, steadies as tries accumulate, and forgets (every
    step multiplies the counts by `decay`), so what is no longer measured drifts back to the prior and
    gets measured again. A row's prior is the worker's acceptance, a worker's prior is `prior`.
    Hysteresis keeps k unless another value is predicted `margin` better; every `explore_every` steps it
    tries one position more than it would, so speculation comes back after a k = 0 phase.
    """

    def __init__(self, max_k: int, max_rows: int, costs: CostModel | None = None, prior: float = 0.6,
                 row_decay: float = 0.97, worker_decay: float = 0.99, prior_tries: float = 2.0,
                 margin: float = 0.03, explore_every: int = 16):
        self.max_k, self.costs, self.prior, self.prior_tries = max_k, costs or CostModel(), prior, prior_tries
        self.row_decay, self.worker_decay, self.margin, self.explore_every = row_decay, worker_decay, margin, explore_every
        self.worker_hits, self.worker_tries = np.zeros(max_k), np.zeros(max_k)
        self.row_hits, self.row_tries = np.zeros((max_rows, max_k)), np.zeros((max_rows, max_k))
        self.k, self.steps = max_k, 0

    @property
    def worker_alpha(self) -> np.ndarray:
        """Each position's prior is the position before it (acceptance rarely drops along a copied span),
        so positions not tried yet are judged by the last ones that were."""
        alpha, prior = np.empty(self.max_k), self.prior
        for i in range(self.max_k):
            alpha[i] = prior = (self.worker_hits[i] + prior * self.prior_tries) / (self.worker_tries[i] + self.prior_tries)
        return alpha

    def row_alpha(self, n_rows: int) -> np.ndarray:
        hits, tries = self.row_hits[:n_rows], self.row_tries[:n_rows]
        return (hits + self.worker_alpha * self.prior_tries) / (tries + self.prior_tries)

    def rate(self, n_rows: int, k: int) -> float:
        """Predicted generated tokens per second for the first n rows at draft length k."""
        gain = expected_tokens(self.row_alpha(n_rows), k).sum()
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
        tried = np.minimum(step.offered, step.accepted + 1)
        positions = np.arange(self.max_k)
        tries = (positions < tried[:, None]).astype(float)
        hits = (positions < step.accepted[:, None]).astype(float)
        self.row_hits[:n] = self.row_hits[:n] * self.row_decay + hits
        self.row_tries[:n] = self.row_tries[:n] * self.row_decay + tries
        self.worker_hits = self.worker_hits * self.worker_decay + hits.sum(0)
        self.worker_tries = self.worker_tries * self.worker_decay + tries.sum(0)

    def admit(self, start: int, count: int) -> None:
        self.row_hits[start : start + count] = 0.0
        self.row_tries[start : start + count] = 0.0

    def move(self, src: int, dst: int) -> None:
        self.row_hits[dst], self.row_tries[dst] = self.row_hits[src], self.row_tries[src]
