"""Choosing each row's draft length from measured acceptance and measured cost.

Per row and position the controller learns how likely the drafter is to reach the position and the
target to accept it (workers/engine/acceptance.py); costs are learnt online (verify time by rows and
width, draft time per column). Each step it offers every row the draft length that maximises the
batch's predicted tokens per second (workers/engine/offers.py): a verify pass costs its widest row,
so a row that copies drafts long while its neighbours draft short or nothing. k = 0 for every row is
plain decoding and wins whenever drafting does not pay. For drafters that report their confidence it
also sets the confidence stop (workers/engine/draft_stop.py) at the same predicted rate.
"""
from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np

from workers.engine.acceptance import ACCEPT, Estimates, trials
from workers.engine.costs import CostModel
from workers.engine.draft_stop import DraftStop
from workers.engine.drafter import DEFAULT_PRIOR
from workers.engine.offers import best_offers, drain_weights, headroom, pass_rates

log = logging.getLogger(__name__)


@dataclass
class StepRecord:
    """What one decoding step did, as the generator saw it."""
    offered: np.ndarray         # (n,) positions offered per row (the controller's offer capped by the row's budget)
    drafted: np.ndarray         # (n,) drafts proposed per row
    accepted: np.ndarray        # (n,) drafts accepted per row
    width: int                  # tokens per row in the verify pass (1 + longest draft)
    draft_s: float
    verify_s: float
    confidence: np.ndarray | None = None  # (n, >= longest draft): the drafter's probability of each draft


class Controller:
    """Base class: `choose` each row's draft length for the next step; the hooks feed it what happened
    and keep per-slot state in step with the live batch (no-ops here)."""

    def choose(self, n_rows: int, remaining: np.ndarray | None = None) -> np.ndarray:
        """(n_rows,) ints: the positions each row may draft. `remaining` (n_rows,): the tokens each row may
        still generate, given only while the batch drains (no prompt waits for a slot)."""
        raise NotImplementedError

    def draft_stop(self) -> DraftStop | None:
        """The confidence stop for the offers just chosen (None: drafts run to their offers)."""
        return None

    def observe(self, step: StepRecord) -> None:
        """What the step that used the chosen offers did."""

    def prefilled(self, tokens: int, seconds: float) -> None:
        """Admitting rows computed `tokens` prompt tokens in `seconds`."""

    def admit(self, start: int, count: int) -> None:
        """`count` new rows enter slots start.."""

    def move(self, src: int, dst: int) -> None:
        """The row in slot `src` now lives in slot `dst`."""


class FixedK(Controller):
    def __init__(self, k: int):
        self.k = k

    def choose(self, n_rows: int, remaining: np.ndarray | None = None) -> np.ndarray:
        return np.full(n_rows, self.k)


class AdaptiveK(Controller):
    """Per-row offers with the most predicted tokens per second, held until another plan is predicted
    `margin` better (so noise does not flap them). A row's prior is the worker's estimates, a worker's
    prior is the drafter's `acceptance_prior` (workers/engine/drafter.py): a cold controller starts near
    k = 0 on open text, where the free shadow guesses (see generator) soon show a copying row, and a copying
    drafter's row that starts to match is trusted deep into the span at once. Where no row has tried
    position 1 for `explore_every` steps (a draft model at k = 0 gets no free guesses), every row is offered
    one position, so speculation can come back; where such a probe costs much more than a plain pass, less
    often, so that probes take at most `probe_share` of the time.

    Between plans the controller coasts: it keeps the held offers and only records the steps, whose trials
    are counted together at the next plan (`Estimates.observe`). Where columns are cheap (a memory-bound pass:
    batch 1 here, a large model on a GPU) a row's acceptance that starts from nearly nothing can grow many-fold
    in a step, so a plan that changed the held offers is followed by a plan every step; once plans keep the
    held offers (in the bench's batch-1 runs, 93-97 % of them do) it coasts twice as many steps after each plan
    that kept them (1, 3, 7 ... up to `max_coast` - 1 steps between plans). A batch that drains and drafts
    plans every step (its rows' drain weights change every step). Where the batch is compute-bound (a further
    column costs at least `hold_share` of a plain pass), every row holds k = 0 and the gains would have to grow
    by a factor (`headroom`) before any drafting could pay, it holds k = 0 for `max_hold` steps.

    A coast ends at once when the rows accept over a token more than the plan expected of their offers (summed
    over the coast: a copy span may be starting, and a late start costs several tokens a step; at k = 0 the
    shadow guesses are the offers), and, while rows draft, when they fall two passes' worth of tokens short (a
    span may have ended; noise at a modest expectation rarely goes that far within a coast); n rows are judged
    by their sum against sqrt(n) times that, so that one lucky row of sixteen does not end every coast, and
    rows that draft deep against two standard deviations of the tokens the plan expected over the coast, when
    that is more (a row offered four positions accepts anything from none to four: in a batch-1 run of six
    tune prompts a one-token rule planned on 45 % of the steps, this one on 35 %). A
    compute-bound hold also tolerates, per expected token, half the growth that drafting would need: rows
    doing a little better than the plan's estimates (which lag a change) cannot make drafting pay, and at
    batch 16 such noise ended most holds within a few steps. A plan costs 1-2 ms of Python within a run on
    this CPU (its caches cold after a pass: each numpy call then costs 10-20 us, so a coasting step reads
    Python lists, and sums the plan's expectations once per offer pattern: a coast repeats one), 4-6 % of a
    batch-1 pass; a coasting step about 0.03 ms. Replayed over greedy
    completions of the tune half (9 prompts a category, n-gram drafts, per-width pass costs measured on
    2026-12-07), coasting made 0.97x the best fixed k's rate against 0.95x for a plan every step; with the
    controller's time left out, 0.99x."""

    def __init__(self, max_k: int, max_rows: int, costs: CostModel | None = None,
                 prior: tuple[tuple[float, ...], tuple[float, ...]] = DEFAULT_PRIOR,
                 row_decays: tuple[float, ...] = (0.7, 0.98), row_prior_tries: tuple[float, ...] = (0.5, 2.0),
                 chain_tries: float = 4.0, worker_decay: float = 0.99, share: float = 0.01, margin: float = 0.02,
                 explore_every: int = 16, probe_share: float = 0.02, max_hold: int = 32,
                 hold_share: float = 0.2, max_coast: int = 8):
        self.max_k, self.costs, self.margin = max_k, costs or CostModel(), margin
        self.prior = np.array([[p[min(j, len(p) - 1)] for j in range(max_k)] for p in prior])  # (2, max_k)
        self.explore_every, self.probe_share = explore_every, probe_share
        self.max_hold, self.hold_share = max_hold, hold_share
        self.estimates = Estimates(max_rows, max_k, row_decays, row_prior_tries, chain_tries, share,
                                   pooled=(worker_decay, row_prior_tries[-1]))   # the rows', under the worker's
        self.held = np.zeros(max_rows, dtype=int)
        self.widths = np.arange(1, max_k + 2)     # the pass widths priced each step
        self.every_offer = np.arange(max_k + 1)[:, None]   # one row's offers, each as a batch of one
        self.unprobed = 0                         # steps since any row tried position 1
        self.probe_after = explore_every          # unprobed steps before a probe, as of the last plan
        self.drafting = False                     # whether any row holds an offer
        self.max_coast, self.steady = max_coast, 0   # plans in a row that kept the held offers
        self.coast = 0                            # steps left to keep the held offers without planning
        self.rows = 0                             # rows in the batch as of the last plan or admission
        # per slot, the mean of the tokens the last plan expected a row to accept of j = 0..max_k offers, then
        # their variance: Python lists, since a coasting step reads a few of them, and after a pass each numpy
        # call costs 10-20 us (its code has fallen out of the cache)
        self.expected = [[0.0] * 2 * (max_k + 1) for _ in range(max_rows)]
        self.per_step = 0.0                       # accepted tokens it expected of the held offers, summed over rows
        self.surprise = 0.0                       # accepted less expected, summed over rows and the coast
        self.coasted = self.spread = 0.0          # accepted tokens expected over the coast, and their variance
        self.tolerance = 0.0                      # surprise tolerated per expected token (a compute-bound hold)
        self._coasting: dict[tuple[int, ...], tuple[float, float]] = {}   # _moments' memo since the last plan
        self.pending: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []  # (offered, drafted, accepted) per step
        self.confidence = (1.0, 1.0)              # decayed (accepted drafts, summed draft confidence)
        self.stop: DraftStop | None = None

    def model(self, n: int) -> tuple[np.ndarray, np.ndarray]:
        """(gain, reach), each (n, max_k): the probability that row r's draft is accepted up to position
        j, and that it reaches position j."""
        self._count_pending()
        est = self.estimates.mixed(n, self.prior)
        reach = np.cumprod(est[:, 0], axis=1)
        return reach * np.cumprod(est[:, ACCEPT], axis=1), reach

    def pass_costs(self, n: int) -> tuple[float, np.ndarray]:
        """Seconds of a pass of width 1, and (max_k,) seconds each further column adds (verify width + draft)."""
        verify = self.costs.verify(n, self.widths)
        return float(verify[0]), np.maximum(np.diff(verify), 0.0) + self.costs.draft(n, 1)

    def choose(self, n_rows: int, remaining: np.ndarray | None = None) -> np.ndarray:
        if self.max_k == 0:
            return np.zeros(n_rows, dtype=int)
        if n_rows == 1:
            remaining = None    # a lone row's drain weight is 1 whatever it has left
        if self.coast and (remaining is None or not self.drafting):
            self.coast -= 1
            return self._probed(self.held[:n_rows].copy() if self.drafting else np.zeros(n_rows, dtype=int))
        gain, reach = self.model(n_rows)
        base, column = self.pass_costs(n_rows)
        weight = None if remaining is None else drain_weights(gain, remaining)
        compute_bound = column[0] >= self.hold_share * base
        if n_rows == 1 and not compute_bound:   # rating each of one row's offers costs less than bounding them
            rates = pass_rates(self.every_offer, gain, reach, base, column)
            held_rate, offers, rate, needed = float(rates[self.held[0]]), rates.argmax(keepdims=True), rates.max(), 1.0
        else:
            held_rate = float(pass_rates(self.held[:n_rows], gain, reach, base, column, weight))
            bound, needed = headroom(gain, reach, base, column, held_rate * (1 + self.margin), weight)
            offers, rate = best_offers(gain, reach, base, column, weight) if bound > 0 else (None, 0.0)
        changed = rate > held_rate * (1 + self.margin)   # offers beating the held ones' rate by the margin
        if changed:
            self.held[:n_rows], held_rate = offers, float(rate)
        chosen = self.held[:n_rows].copy()
        self.drafting = bool(chosen.any())
        self.steady = 0 if changed else self.steady + 1
        self.coast = self._coast_after_plan(remaining is not None, compute_bound, needed)
        self.rows, self.expected[:n_rows] = n_rows, _accepted_moments(gain).tolist()
        self._coasting = {}
        self.per_step = self._moments(chosen.tolist())[0]
        self.surprise = self.coasted = self.spread = 0.0
        self.probe_after = max(self.explore_every, column[0] / base / self.probe_share)
        chosen = self._probed(chosen)
        calibration = self.confidence[0] / self.confidence[1]
        self.stop = DraftStop(held_rate * column, calibration, weight)
        if log.isEnabledFor(logging.DEBUG):   # its arguments cost more than the rest of choose
            log.debug("gain=%s base=%.3gs column=%s -> offers=%s (%.1f tok/s)", np.round(gain.sum(0), 2), base,
                      np.round(column, 4), chosen, held_rate)
        return chosen

    def _coast_after_plan(self, draining: bool, compute_bound: bool, needed: float) -> int:
        """Steps to keep the offers just planned without planning again: twice as many after each plan that
        kept them (not while a draining batch drafts: its rows' drain weights change every step), and where
        the batch is compute-bound and holds k = 0 while gains would have to grow `needed`-fold before any
        drafting paid, `max_hold`; such a hold also tolerates rows beating the plan by half that growth."""
        coast = 0 if draining and self.drafting else min(2 ** max(self.steady - 1, 0), self.max_coast) - 1
        held = compute_bound and not self.drafting and needed > 1
        self.tolerance = (needed - 1) / 2 if held else 0.0
        return max(coast, self.max_hold) if held else coast

    def _probed(self, chosen: np.ndarray) -> np.ndarray:
        """The offers, or one position for every row where nobody has tried one for `probe_after` steps."""
        if not self.drafting and self.unprobed >= self.probe_after:
            chosen[:] = 1
        return chosen

    def draft_stop(self) -> DraftStop | None:
        return self.stop

    def observe(self, step: StepRecord) -> None:
        if self.max_k == 0:
            return
        n = len(step.offered)
        self.costs.observe(n, step.width, step.verify_s, step.width - 1, step.draft_s)
        self.pending.append((step.offered, step.drafted, step.accepted))
        offered = step.offered.tolist()
        self.unprobed = 0 if any(offered) else self.unprobed + 1
        if self.coast and self.drafting and n != self.rows:
            self.coast = 0          # the batch shrank without a move (its last slot retired): plan afresh
        if self.coast:
            expected, variance = self._moments(offered)
            self.surprise += sum(step.accepted.tolist()) - expected
            self.coasted += expected
            self.spread += variance
            spread = math.sqrt(n)   # rows' luck adds up as a random walk's
            if self.surprise > max(spread, 2.0 * math.sqrt(self.spread)) + self.tolerance * self.coasted or \
                    (self.drafting and self.surprise < -2.0 * (spread + self.per_step / spread)):
                self.coast = 0      # the rows gained a token more than the plan expected, or lost two passes' worth
        if step.confidence is not None:
            self._calibrate(step.confidence.tolist(), step.drafted.tolist(), step.accepted.tolist())

    def _calibrate(self, confidence: list[list[float]], drafted: list[int], accepted: list[int]) -> None:
        """Count the step's drafts into the calibration: each position the target judged (drafted, and the one
        before it accepted) adds its confidence, and a hit if accepted; NaN (a part that reports none) is left
        out. Plain Python: a few numbers a step, where each numpy call costs 10-20 us after a pass."""
        hits = summed = 0.0
        for row, length, kept in zip(confidence, drafted, accepted):
            for j, q in enumerate(row[: min(length, kept + 1)]):
                if q == q:
                    hits, summed = hits + (j < kept), summed + q
        self.confidence = (0.99 * self.confidence[0] + hits, 0.99 * self.confidence[1] + summed)

    def _moments(self, offered: list[int]) -> tuple[float, float]:
        """The mean and variance of the tokens the last plan expected the rows to accept of these offers,
        summed over rows: remembered per offer pattern, as a coast repeats one (the held offers, or at k = 0
        the shadow guesses) step after step."""
        key = tuple(offered)
        moments = self._coasting.get(key)
        if moments is None:
            moments = self._coasting[key] = (sum(row[j] for row, j in zip(self.expected, offered)),
                                             sum(row[j + self.max_k + 1] for row, j in zip(self.expected, offered)))
        return moments

    def _count_pending(self) -> None:
        """Count the steps recorded since the last plan into the estimates, all at once."""
        if not self.pending:
            return
        n = max(len(offered) for offered, _, _ in self.pending)
        if all(len(offered) == n for offered, _, _ in self.pending):
            record = np.array(self.pending).transpose(1, 0, 2)        # (offered, drafted, accepted) x steps x rows
        else:
            record = np.zeros((3, len(self.pending), n), dtype=int)   # a step with fewer rows tried nothing past them
            for t, step in enumerate(self.pending):
                for field, values in zip(record, step):
                    field[t, : len(values)] = values
        self.estimates.observe(*trials(*record, self.max_k), self.prior)
        self.pending.clear()

    def prefilled(self, tokens: int, seconds: float) -> None:
        self.costs.observe_prefill(tokens, seconds)

    def admit(self, start: int, count: int) -> None:
        """New rows take the held offers' longest and, for the coast's expectations, the other rows' mean; a
        batch that drafts plans afresh (one that holds k = 0 goes on coasting)."""
        self.coast = 0 if self.drafting else self.coast
        self._count_pending()
        self.estimates.reset(start, count)
        self.held[start : start + count] = self.held[:start].max(initial=0)
        width = len(self.expected[0])
        mean = [sum(column) / start for column in zip(*self.expected[:start])] if start else [0.0] * width
        self.expected[start : start + count] = [mean] * count
        self._coasting = {}
        self.rows = start + count

    def move(self, src: int, dst: int) -> None:
        self.coast = 0 if self.drafting else self.coast
        self._count_pending()
        self.estimates.move(src, dst)
        self.held[dst], self.expected[dst] = self.held[src], self.expected[src]
        self._coasting = {}


def _accepted_moments(gain: np.ndarray) -> np.ndarray:
    """(n, 2 (max_k + 1)): per row, the mean of the drafts accepted of j = 0..max_k offers, then their variance;
    gain[r, i - 1] is the probability that at least i are accepted, so E[A] = sum_i gain_i and
    E[A^2] = sum_i (2i - 1) gain_i."""
    zero = np.zeros((len(gain), 1))
    mean = np.concatenate([zero, gain.cumsum(1)], 1)
    square = np.concatenate([zero, (gain * np.arange(1, 2 * gain.shape[1], 2)).cumsum(1)], 1)
    return np.concatenate([mean, square - mean * mean], 1)
