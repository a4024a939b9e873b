"""The trace oracle: the best pass width per step in hindsight, priced by what the cell measured.

Every run of this generator in a cell keeps a trace (generate(trace=True)): per step, each row's offered,
drafted and accepted positions, the pass width and the measured draft and verify seconds. All of a
cell's traces fit one cost model: verify seconds by (rows, width) (workers/engine/costs.py's CostModel,
every pass of a cell averaged, unmeasured widths interpolated: not priced low to get them tried) and draft seconds per drafted column. A run's modelled rate is its
steps' tokens (accepted drafts + 1 per row) over their modelled seconds: every run in one currency,
without the noise of single passes, and without the machine's speed drifting between runs. The run's own
controller seconds (measured) are added: they are what adaptive k pays that fixed k does not.

The oracle is computed on one reference trace: the widest fixed k's run, whose rows were offered the
most, so the fewest acceptance lengths are cut short by an offer. With hindsight of each row's
acceptance length a_r at a step and its draft length d_r, a pass of width w yields
sum_r (min(a_r, w - 1) + 1) tokens for verify(n, w') + draft(w' - 1) seconds, w' = 1 + max_r min(d_r, w - 1)
(no row drafts past what it proposed). Offering every row w - 1 is as good as any per-row offers within
w - 1: a row's tokens only grow with its offer, and the pass costs its widest row either way. The oracle
picks each step's w to maximise the trace's tokens over its seconds (Dinkelbach's iteration on a ratio
of sums of independent choices: exact). A row that accepted all it was offered (a_r = d_r = offer) might
have accepted more: the oracle counts only what was observed, so where the reference's k is below max_k
it is a lower estimate of the hindsight optimum. On its own steps it is an upper bound on any per-step
choice of offers, the reference run's own included; other runs' steps are other situations of the same
rows, so their rate over the oracle's says how close they came, not a strict bound.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from workers.engine.controller import StepRecord
from workers.engine.costs import CostModel

Trace = list[StepRecord]


@dataclass
class StepCosts:
    verify: CostModel
    draft_per_column: float

    def seconds(self, n: int, width: np.ndarray) -> np.ndarray:
        """Modelled seconds of a step of n rows at each pass width (array)."""
        return self.verify.verify(n, width) + self.draft_per_column * (width - 1)


def fit_costs(traces: list[Trace]) -> StepCosts:
    """The cost model of a cell: every measured pass's verify seconds by (rows, width), and draft seconds over
    drafted columns."""
    verify, draft_s, columns = CostModel(memory=None, refit_every=1, stale_after=None, explore=False), 0.0, 0
    for step in (s for trace in traces for s in trace):
        verify.observe(len(step.offered), step.width, step.verify_s, 0, 0.0)
        if step.width > 1:
            draft_s, columns = draft_s + step.draft_s, columns + step.width - 1
    return StepCosts(verify, draft_s / columns if columns else 0.0)


def run_rate(trace: Trace, costs: StepCosts, controller_s: float = 0.0) -> float:
    """Modelled tokens per second of a run's steps as they ran, plus the seconds its controller took (its own
    overhead, which the passes' cost model does not hold)."""
    tokens = sum(int(s.accepted.sum()) + len(s.accepted) for s in trace)
    seconds = sum(float(costs.seconds(len(s.accepted), np.array(s.width))) for s in trace) + controller_s
    return tokens / seconds if seconds else 0.0


def _choices(step: StepRecord, widths: np.ndarray, costs: StepCosts) -> tuple[np.ndarray, np.ndarray]:
    """Tokens and modelled seconds of one step at each candidate pass width, with hindsight of its rows."""
    offers = widths - 1
    tokens = np.minimum(step.accepted[:, None], offers).sum(0) + len(step.accepted)
    return tokens, costs.seconds(len(step.accepted), 1 + np.minimum(step.drafted[:, None], offers).max(0))


def oracle_rate(trace: Trace, costs: StepCosts, max_k: int) -> float:
    """The highest modelled tokens per second of the trace's steps, each at its best width in hindsight."""
    if not trace:
        return 0.0
    tokens, seconds = (np.array(parts) for parts in zip(*(_choices(s, np.arange(1, max_k + 2), costs) for s in trace)))
    steps, rate = np.arange(len(trace)), 0.0
    while True:
        chosen = (tokens - rate * seconds).argmax(axis=1)
        better = tokens[steps, chosen].sum() / seconds[steps, chosen].sum()
        if better <= rate * (1 + 1e-12):
            return rate
        rate = better
