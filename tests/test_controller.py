"""Draft length: measured tokens per verify pass against Leviathan et al.'s formula; per-row offers against
a brute-force optimum of the same cost model; the adaptive controller on synthetic acceptance traces
(stationary, and rows that start or stop copying) against argmaxes computed here, independently; confidence
stops; and greedy output with per-row lengths and stops against transformers' own generate.

The formula (Leviathan et al. 2023, i.i.d. acceptance alpha): a verify pass of k drafts yields
(1 - alpha^(k+1)) / (1 - alpha) tokens on average; with per-position acceptance a_1..a_k it is
1 + sum_j prod_{i<=j} a_i. Generated tokens per second at draft length k is that, summed over the
batch's rows, divided by the time of k draft steps plus one verify pass of k + 1 tokens.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from tests.test_generator import GREEDY, draft, make_drafter, prompt_ids, references, requests_for, target, tok  # noqa: F401
from tests.test_generator import MAX_K as GEN_MAX_K
from tests.test_generator import MAX_NEW as GEN_MAX_NEW
from tests.pipeline_helpers import make_config
from tests.tiny_models import OracleDrafter, StubTokenizer, tiny_llama
from workers.engine.acceptance import ACCEPT, REACH, Estimates, trials
from workers.engine.controller import AdaptiveK, Controller, FixedK, StepRecord
from workers.engine.costs import CostModel
from workers.engine.decoding_model import DecodingModel
from workers.engine.draft_stop import DraftStop
from workers.engine.drafter import COPY_PRIOR, DEFAULT_PRIOR
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.model_drafter import ModelDrafter
from workers.engine.offers import best_offers, headroom, pass_rates
from workers.engine.sampling import verify_greedy
from workers.registry import load_models, make_generator


def leviathan(alpha: float, k: int) -> float:
    return (1 - alpha ** (k + 1)) / (1 - alpha) if alpha < 1 else k + 1.0


def leviathan_variance(alpha: float, k: int) -> float:
    """Variance of tokens per pass, 1 + A, where A (accepted drafts) is a geometric truncated at k."""
    probs = [alpha**a * (1 - alpha) for a in range(k)] + [alpha**k]
    values = np.arange(k + 1) + 1.0
    mean = float(np.dot(probs, values))
    return float(np.dot(probs, (values - mean) ** 2))


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ------------------------------------------------------------------- tokens per verify pass: the formula

@pytest.mark.parametrize("alpha", [0.2, 0.5, 0.8, 0.95])
@pytest.mark.parametrize("k", [1, 2, 4, 8])
def test_verify_greedy_tokens_per_pass_match_leviathan(alpha, k):
    """Synthetic target logits; drafts equal the target's argmax i.i.d. with probability alpha."""
    rows, vocab = 20_000, 50
    gen = torch.Generator().manual_seed(int(alpha * 100) * 10 + k)
    logits = torch.randn(rows, k + 1, vocab, generator=gen)
    targets = logits.argmax(-1)[:, :k]
    right = torch.rand(rows, k, generator=gen) < alpha
    wrong = (targets + torch.randint(1, vocab, (rows, k), generator=gen)) % vocab
    drafts = torch.where(right, targets, wrong)
    verdict = verify_greedy(logits, drafts, torch.full((rows,), k))
    tokens = verdict.accepted.double() + 1
    assert all(len(t) == a + 1 for t, a in zip(verdict.tokens, verdict.accepted.tolist()))
    expected, sd = leviathan(alpha, k), np.sqrt(leviathan_variance(alpha, k) / rows)
    assert abs(float(tokens.mean()) - expected) < 4.5 * sd, (float(tokens.mean()), expected)


class Recorder(FixedK):
    """A fixed k that keeps every StepRecord the generator reports."""

    def __init__(self, k: int):
        super().__init__(k)
        self.steps: list[StepRecord] = []

    def observe(self, step: StepRecord) -> None:
        self.steps.append(step)


VOCAB, ROWS, PROMPT_LEN, LONG = 64, 8, 6, 160


@pytest.fixture(scope="module")
def long_run():
    """A small target without EOS, and its greedy continuations from transformers' own generate (equal
    prompt lengths, so one batched call needs no padding)."""
    target = tiny_llama(VOCAB, seed=3, hidden=32, layers=1)
    target.generation_config.eos_token_id = None
    gen = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, VOCAB, (ROWS, PROMPT_LEN), generator=gen)
    out = target.generate(prompts, attention_mask=torch.ones_like(prompts), do_sample=False, max_new_tokens=LONG,
                          pad_token_id=0)
    references = {tuple(p): o[PROMPT_LEN:] for p, o in zip(prompts.tolist(), out.tolist())}
    return target, prompts.tolist(), references


@pytest.mark.parametrize("alpha,k", [(0.5, 2), (0.5, 6), (0.85, 3), (0.85, 8)])
def test_generator_tokens_per_pass_with_synthetic_drafter_match_leviathan(long_run, alpha, k):
    """Through the real generator and tiny target, with a plugged-in drafter agreeing i.i.d. with
    probability alpha. Edge effects are accounted for: only row-steps offered the full k count, and the
    counts must add up to every generated token."""
    target, prompts, references = long_run
    controller = Recorder(k)
    drafter = OracleDrafter(references, alpha, VOCAB, seed=11)
    generator = SpeculativeGenerator(DecodingModel.prepare(target), StubTokenizer(), drafter, controller,
                                     GenerationSettings(max_new_tokens=LONG, batch_size=ROWS, max_k=8))
    result = generator.generate([Request(str(i), p, i) for i, p in enumerate(prompts)])
    results, stats = result.completions, result.stats
    assert [r.token_ids for r in results] == [references[tuple(p)] for p in prompts]

    full = np.concatenate([s.accepted[s.offered == k] for s in controller.steps]) + 1.0
    expected, sd = leviathan(alpha, k), np.sqrt(leviathan_variance(alpha, k) / len(full))
    assert len(full) >= 150
    assert abs(full.mean() - expected) < 4.5 * sd, (full.mean(), expected, len(full))
    # accounting: each row-step yields its accepted drafts plus one token, and nothing is lost at the edges
    row_steps = sum(len(s.accepted) for s in controller.steps)
    assert stats.generated_tokens == ROWS * LONG == stats.accepted_tokens + row_steps
    assert stats.target_passes == len(controller.steps)
    # per-position acceptance (conditional on reaching the position) is alpha at every position
    tried = stats.attempted_by_position
    for position in range(k):
        if tried[position] >= 100:
            sd = np.sqrt(alpha * (1 - alpha) / tried[position])
            assert abs(stats.accept_by_position[position] - alpha) < 4.5 * sd, position


def test_a_trace_records_each_step_as_it_ran(long_run):
    """generate(trace=True): one StepRecord per target pass, as verified, adding up to every generated token; a
    step in which no row drafted shows no drafts, though the controller was shown the free guesses."""
    target, prompts, references = long_run
    seen = []

    class Watching(AdaptiveK):
        def observe(self, step: StepRecord) -> None:
            seen.append(step)
            super().observe(step)

    never = OracleDrafter(references, 0.0, VOCAB)
    generator = SpeculativeGenerator(DecodingModel.prepare(target), StubTokenizer(), never, Watching(8, ROWS),
                                     GenerationSettings(max_new_tokens=LONG, batch_size=ROWS, max_k=8))
    requests = [Request(str(i), p, i) for i, p in enumerate(prompts)]
    result = generator.generate(requests, trace=True)
    steps = result.steps
    assert len(steps) == len(seen) == result.stats.target_passes
    assert sum(int(s.accepted.sum()) + len(s.accepted) for s in steps) == result.stats.generated_tokens
    assert all(s.width == 1 + int(s.drafted.max()) and s.verify_s > 0 for s in steps)
    plain = [(s, o) for s, o in zip(steps, seen) if not s.offered.any()]
    assert all(not s.drafted.any() for s, _ in plain) and sum(o.offered.any() for _, o in plain) > len(plain) / 2
    assert generator.generate(requests).steps is None


# ------------------------------------------------------------------ per-row offers: the same cost model, brute force

def length_distribution(reach_row: np.ndarray, offer: int) -> list[float]:
    """P(the row drafts exactly l positions), l = 0..offer, from P(it reaches position j) (cumulative)."""
    at_least = [1.0] + list(reach_row[:offer]) + [0.0]
    return [at_least[l] - at_least[l + 1] for l in range(offer + 1)]


def enumerated_rate(offers, gain: np.ndarray, reach: np.ndarray, base: float, column: np.ndarray) -> float:
    """Tokens per second by enumerating every joint outcome of the rows' draft lengths: the pass's width is
    the longest draft and costs base + the columns it spans (no product formula, unlike offers.py)."""
    tokens = len(offers) + sum(gain[r, :k].sum() for r, k in enumerate(offers))
    time = 0.0
    for lengths in itertools.product(*(range(k + 1) for k in offers)):
        p = np.prod([length_distribution(reach[r], k)[l] for r, (k, l) in enumerate(zip(offers, lengths))])
        time += p * (base + column[: max(lengths, default=0)].sum())
    return tokens / time


def random_case(rng, n: int, width: int):
    """Rows mixing draft models (reach 1) and model-free drafters (a first match, then a span that may end),
    acceptance per row or per position, costs with an optional tile jump."""
    step = np.where(rng.random((n, 1)) < 0.3, 1.0, rng.uniform(0.2, 1.0, (n, width)))
    step[:, 1:] = np.where(rng.random((n, width - 1)) < 0.5, 1.0, step[:, 1:])
    accept = rng.beta(0.5, 0.5, (n, 1)).repeat(width, 1) if rng.random() < 0.5 else rng.random((n, width))
    column = rng.uniform(0, 0.5, width) * (n if rng.random() < 0.5 else 1)
    if rng.random() < 0.3:
        column[rng.integers(width)] += rng.uniform(0, 2)
    return np.cumprod(step * accept, 1), np.cumprod(step, 1), 1.0, column


def test_pass_rate_formula_matches_enumeration():
    rng = np.random.default_rng(0)
    for _ in range(100):
        n, width = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        gain, reach, base, column = random_case(rng, n, width)
        offers = rng.integers(0, width + 1, n)
        assert pass_rates(offers, gain, reach, base, column) == pytest.approx(
            enumerated_rate(offers, gain, reach, base, column), rel=1e-9)


def test_best_offers_match_the_brute_force_optimum():
    """Every offer vector of small batches, rated by enumeration: the search finds the optimum."""
    rng = np.random.default_rng(1)
    ratios = []
    for _ in range(250):
        n, width = int(rng.integers(1, 4)), int(rng.integers(1, 4))
        gain, reach, base, column = random_case(rng, n, width)
        offers, rate = best_offers(gain, reach, base, column)
        assert rate == pytest.approx(enumerated_rate(offers, gain, reach, base, column), rel=1e-9)
        best = max(enumerated_rate(o, gain, reach, base, column)
                   for o in itertools.product(range(width + 1), repeat=n))
        ratios.append(rate / best)
    assert min(ratios) > 1 - 1e-4 and np.mean(np.array(ratios) > 1 - 1e-9) >= 0.99, sorted(ratios)[:5]


def test_headroom_bounds_every_offer_and_rules_out_a_search_that_cannot_pay():
    """`headroom` lets the controller skip the search, and planning itself while far from paying: its bound
    must be positive wherever some offers (all of them rated here) beat the rate, and negative where no
    column could pay (every column costs more than every row's gain at it); its factor must leave every
    drafting offer short of plain decoding when the gains grow by less, and be larger where columns cost more."""
    rng = np.random.default_rng(4)
    for _ in range(300):
        n, width = int(rng.integers(1, 4)), int(rng.integers(1, 5))
        gain, reach, base, column = random_case(rng, n, width)
        weight = rng.uniform(0.1, 1.0, n) if rng.random() < 0.3 else None
        best = max(pass_rates(np.array(o), gain, reach, base, column, weight)
                   for o in itertools.product(range(width + 1), repeat=n))
        assert headroom(gain, reach, base, column, best * (1 - 1e-9), weight)[0] > 0
        plain = float(pass_rates(np.zeros(n, dtype=int), gain, reach, base, column, weight))
        needed = headroom(gain, reach, base, column, plain, weight)[1]
        if needed > 1:   # gains grown by less than the factor: still no drafting offer beats plain decoding
            scaled = gain * needed * (1 - 1e-9)
            assert all(pass_rates(np.array(o), scaled, reach, base, column, weight) <= plain * (1 + 1e-12)
                       for o in itertools.product(range(width + 1), repeat=n))
    reach = np.cumprod(np.full((16, MAX_K), 0.8), 1)
    gain = reach * np.cumprod(np.full((16, MAX_K), 0.5), 1)
    plain = pass_rates(np.zeros(16, dtype=int), gain, reach, 1.0, np.full(MAX_K, 0.9))   # 16 tokens per second
    bound, needed = headroom(gain, reach, 1.0, np.full(MAX_K, 0.9), plain * 1.02)
    assert bound < 0 and needed > headroom(gain, reach, 1.0, np.full(MAX_K, 0.5), plain * 1.02)[1] > 1
    assert headroom(gain, reach, 1.0, np.full(MAX_K, 0.1), plain * 1.02)[0] > 0


def test_offers_are_one_k_when_every_draft_reaches_its_offer():
    """A draft model always drafts what it is offered: the pass costs the longest offer, so the best plan is
    one k for the batch, the argmax of the formula (computed independently by true_rates)."""
    rng = np.random.default_rng(2)
    for _ in range(30):
        n, alpha = 6, rng.uniform(0.05, 0.95, (6, MAX_K))
        verify, draft = linear(1.0, rng.uniform(0.001, 0.05)), (lambda n, k, c=rng.uniform(0, 0.1): c * k)
        widths = [verify(n, w) for w in range(1, MAX_K + 2)]
        offers, rate = best_offers(np.cumprod(alpha, 1), np.ones((n, MAX_K)), widths[0],
                                   np.diff(widths) + draft(n, 1))
        rates = true_rates(alpha, verify, draft, MAX_K)
        assert len(set(offers)) == 1 and rate == pytest.approx(rates.max(), rel=1e-9)


def test_a_copying_row_drafts_long_while_its_neighbours_draft_short():
    """One row copies (matches nearly always, accepted 0.95 per position); three find junk matches half the
    time (accepted 0.1). One k for all would either stop the copier or widen every pass for the junk."""
    reach = np.cumprod(np.array([[0.95] * MAX_K] + [[0.5] + [0.95] * (MAX_K - 1)] * 3), 1)
    accept = np.array([[0.95] * MAX_K] + [[0.1] * MAX_K] * 3)
    base, column = 1.0, np.full(MAX_K, 0.06)
    offers, rate = best_offers(reach * np.cumprod(accept, 1), reach, base, column)
    uniform = max(pass_rates(np.full(4, k), reach * np.cumprod(accept, 1), reach, base, column) for k in range(MAX_K + 1))
    assert offers[0] >= 6 and max(offers[1:]) <= 1, offers
    assert rate > 1.05 * uniform


# ------------------------------------------------------------------------------- the adaptive controller

class SyntheticCosts:
    """Verify and draft times set by the test; observe() only counts, so nothing is learnt."""

    def __init__(self, verify, draft):
        self._verify, self._draft, self.observed = verify, draft, 0

    def verify(self, n: int, width: np.ndarray) -> np.ndarray:
        return np.array([self._verify(n, w) for w in width])

    def draft(self, n: int, k: int) -> float:
        return self._draft(n, k)

    def observe(self, n: int, width: int, verify_s: float, columns: int, draft_s: float) -> None:
        self.observed += 1


def true_rates(alpha_rows: np.ndarray, verify, draft, max_k: int) -> np.ndarray:
    """Tokens per second for one k = 0..max_k for every row, drafts always reaching k, from the formula with
    plain loops (not the controller's code)."""
    n, rates = len(alpha_rows), []
    for k in range(max_k + 1):
        gain = 0.0
        for row in alpha_rows:
            reach, expected = 1.0, 1.0
            for j in range(k):
                reach *= row[j]
                expected += reach
            gain += expected
        rates.append(gain / (draft(n, k) + verify(n, k + 1)))
    return np.array(rates)


@dataclass
class Trace:
    chosen: list[np.ndarray]     # offers per step
    held: list[np.ndarray]       # the controller's held plan per step
    tokens: float = 0.0
    seconds: float = 0.0

    def changes(self, start: int = 0) -> list[int]:
        """Steps at which the held offers changed."""
        return [t for t in range(start + 1, len(self.held)) if (self.held[t] != self.held[t - 1]).any()]

    def flaps(self, start: int = 0, within: int = 10) -> int:
        """Changes that undo the change before them within `within` steps (back and forth)."""
        changes = self.changes(start)
        return sum(b - a <= within and (self.held[b] == self.held[a - 1]).all() for a, b in itertools.pairwise(changes))


def simulate(controller, phase_at, n: int, steps: int, verify, draft, rng, shadow: bool = False,
             trace: Trace | None = None) -> Trace:
    """Drive the controller with StepRecords of a simulated drafter. phase_at(t) gives per row and position
    the probability that the draft goes on to position j and that the target accepts it, (n, MAX_K) each.
    With `shadow` (a model-free drafter), a step where no row drafts still guesses one token for free."""
    trace = trace or Trace([], [])
    position = np.arange(MAX_K)
    for t in range(steps):
        offers = controller.choose(n)
        goes_on, accept = phase_at(len(trace.chosen))
        free = shadow and not offers.any()
        tried = np.ones(n, dtype=int) if free else offers
        drafted = (np.cumprod(rng.random((n, MAX_K)) < goes_on, 1) * (position < tried[:, None])).sum(1)
        accepted = (np.cumprod(rng.random((n, MAX_K)) < accept, 1) * (position < drafted[:, None])).sum(1)
        width = 0 if free else int(drafted.max())
        draft_s, verify_s = draft(n, width), verify(n, width + 1)
        controller.observe(StepRecord(tried, drafted, accepted, width + 1, draft_s, verify_s))
        trace.chosen.append(offers)
        trace.held.append(controller.held[:n].copy())
        trace.tokens += n + (0 if free else accepted.sum())
        trace.seconds += draft_s + verify_s
    return trace


def drain(controller, goes_on: np.ndarray, accept: np.ndarray, budget: int, verify, rng, draining: bool) -> float:
    """Seconds until a batch with no prompt waiting finishes: rows (goes_on and accept per row and position, as
    in simulate) leave when they have generated `budget` tokens and the rows after them move down a slot, as
    in the generator. `draining` shows the controller each row's remaining budget."""
    rows, left, seconds, position = list(range(len(goes_on))), np.full(len(goes_on), budget), 0.0, np.arange(MAX_K)
    while rows:
        n = len(rows)
        offers = np.minimum(controller.choose(n, left[rows] if draining else None), left[rows] - 1)
        tried = offers if offers.any() else np.ones(n, dtype=int)
        drafted = (np.cumprod(rng.random((n, MAX_K)) < goes_on[rows], 1) * (position < tried[:, None])).sum(1)
        accepted = (np.cumprod(rng.random((n, MAX_K)) < accept[rows], 1) * (position < drafted[:, None])).sum(1)
        width = int(drafted.max()) if offers.any() else 0
        controller.observe(StepRecord(tried, drafted, accepted, width + 1, 0.0, verify(n, width + 1)))
        seconds += verify(n, width + 1)
        left[rows] -= 1 + (accepted if offers.any() else 0)
        done = left[rows] <= 0
        for dst, src in enumerate([slot for slot in range(n) if not done[slot]]):
            controller.move(src, dst)
        rows = [row for row, finished in zip(rows, done) if not finished]
    return seconds


@pytest.mark.parametrize("copying", [1, 4])
def test_a_draining_batch_drafts_for_the_rows_it_waits_for(copying):
    """No prompt waits: the batch ends with its slowest row. With one copying row among rows that find no
    match, widening every pass for the copier only makes the others (who set the end) wait, so seeing the
    budgets finishes sooner; when every row copies, speculation still pays and is kept."""
    n, budget = 4, 32
    goes_on = np.array([[1.0] * MAX_K] * copying + [[0.0] * MAX_K] * (n - copying))
    accept = np.full((n, MAX_K), 0.95)
    verify = linear(1.0, 0.05)
    seconds = {mode: np.mean([drain(AdaptiveK(MAX_K, n, costs=SyntheticCosts(verify, lambda n, k: 0.0)), goes_on,
                                    accept, budget, verify, np.random.default_rng(seed), mode == "drain")
                              for seed in range(6)]) for mode in ("drain", "throughput")}
    plain = budget * verify(n, 1)
    if copying == 1:
        assert seconds["drain"] < 0.95 * seconds["throughput"], seconds
        assert seconds["drain"] <= 1.01 * plain
    else:
        assert seconds["drain"] <= 1.02 * seconds["throughput"] and seconds["drain"] < 0.7 * plain, seconds


def test_cost_model_tries_wider_passes_before_it_has_measured_them():
    """Only width-1 passes measured (at several row counts, as a batch drains): a further column is assumed
    to cost `column_share` of a width-1 pass, not a guess from a fit that cannot separate rows from columns."""
    costs = CostModel(column_share=0.1)
    for n in (16, 15, 14):
        costs.observe(n, 1, 0.1 + 0.01 * n, 0, 0.0)
    assert costs.verify(16, 3) == pytest.approx(0.26 * 1.2)
    assert costs.verify(8, 2) == pytest.approx(costs.verify(8, 1) * 1.1)
    costs.observe(16, 5, 0.5, 4, 0.0)      # one wider pass measured: its slope takes over
    assert costs.verify(16, 3) == pytest.approx((0.26 + 0.5) / 2)


def test_before_wider_passes_are_measured_columns_are_priced_by_the_roofline_of_the_prefills():
    """Reading the weights takes 20 ms (floor_s) and a prefill computed 1000 tokens in 2 s: 2 ms a token. A
    batch of one computes 9 tokens in less than the read, so a width-9 pass costs a width-1 pass; a batch of 16
    is compute-bound at width 1, so each column costs another 16 tokens' compute (32 ms), before any wider pass
    was measured, and from the first plan, before any pass was."""
    costs = CostModel(floor_s=0.020)
    costs.observe_prefill(30, 0.035)        # shorter than twice the read: says nothing of the compute rate
    assert costs.token_s is None
    costs.observe_prefill(1000, 2.0)
    np.testing.assert_allclose(costs.verify(16, np.array([1, 2, 3])), [0.032, 0.064, 0.096])
    np.testing.assert_allclose(costs.verify(1, np.array([1, 9, 12])), [0.020, 0.020, 0.024])
    costs.observe(16, 1, 0.050, 0, 0.0)     # a measured width-1 pass: the roofline prices its columns only
    np.testing.assert_allclose(costs.verify(16, np.array([1, 3])), [0.050, 0.050 + 2 * 0.032])
    costs.observe(1, 1, 0.025, 0, 0.0)
    np.testing.assert_allclose(costs.verify(1, np.array([9, 12])), [0.025, 0.029])
    without = CostModel(column_share=0.1)   # no floor measured (a GPU): the optimistic share
    without.observe_prefill(1000, 2.0)
    without.observe(16, 1, 0.050, 0, 0.0)
    assert without.verify(16, 3) == pytest.approx(0.060)


@pytest.mark.parametrize("rows, drafts", [(16, False), (1, True)])
def test_a_cold_controller_drafts_at_its_first_plan_only_where_the_prefills_roofline_says_columns_are_cheap(rows, drafts):
    """A worker's first plan, with nothing measured but the weights' read (20 ms) and its prefill (2 ms a
    token): 16 rows hold k = 0 (a column costs a whole pass), where the optimistic share drafted every row
    (a width-4 pass, 2.5x a plain one, seen at a cold bench start); one row drafts."""
    costs = CostModel(floor_s=0.020)
    controller = AdaptiveK(8, rows, costs=costs, prior=COPY_PRIOR)
    controller.prefilled(1000, 2.0)
    assert controller.choose(rows).any() == drafts
    assert AdaptiveK(8, rows, costs=CostModel(), prior=COPY_PRIOR).choose(rows).all()


def test_where_measured_columns_are_cheap_twice_the_widest_width_is_priced_as_the_widest():
    """A memory-bound pass (a further column under cheap_share of a plain pass) is tried wider before it is
    assumed to grow; a compute-bound one is extended along its slope."""
    cheap, dear = CostModel(), CostModel()
    for width, seconds in ((1, 0.030), (3, 0.036)):
        cheap.observe(1, width, seconds, width - 1, 0.0)
    for width, seconds in ((1, 0.08), (2, 0.12)):
        dear.observe(16, width, seconds, width - 1, 0.0)
    np.testing.assert_allclose(cheap.verify(1, np.array([3, 5, 6, 8])), [0.036, 0.036, 0.036, 0.042])
    np.testing.assert_allclose(dear.verify(16, np.array([2, 3, 4])), [0.12, 0.16, 0.20])
    # between two measured widths the cheap slope prices an unmeasured width as the cheaper one, so that it is
    # tried (on an AVX2 CPU a width-5 pass measured 25.0 ms against 25.7 at width 4); a dear slope interpolates
    np.testing.assert_allclose(cheap.verify(1, np.array([1, 2, 3])), [0.030, 0.030, 0.036])
    dear.observe(16, 4, 0.20, 3, 0.0)
    np.testing.assert_allclose(dear.verify(16, np.array([2, 3, 4])), [0.12, 0.16, 0.20])
    model = CostModel(explore=False)   # a model of passes already run (the oracle) tries nothing: it interpolates
    for width, seconds in ((1, 0.030), (3, 0.036)):
        model.observe(1, width, seconds, width - 1, 0.0)
    np.testing.assert_allclose(model.verify(1, np.array([2, 5])), [0.033, 0.042])


def test_cost_model_refits_after_new_cells_or_every_few_passes_not_every_pass(monkeypatch):
    """A batch holding one width is priced from the fit at every plan: the fit is redone after a new cell at
    once, and otherwise once `refit_every` passes have moved the means, so its prices follow within that."""
    fits, lstsq = [], np.linalg.lstsq
    monkeypatch.setattr(np.linalg, "lstsq", lambda *a, **k: fits.append(1) or lstsq(*a, **k))
    costs, fresh = CostModel(refit_every=8), CostModel(refit_every=1)
    for model in (costs, fresh):
        model.observe(8, 1, 0.1, 0, 0.0)
        model.observe(8, 3, 0.2, 2, 0.0)
    for step in range(64):
        for model in (costs, fresh):
            model.observe(16, 1, 0.3 + 0.001 * step, 0, 0.0)
        costs.verify(16, np.arange(1, 10))
    assert 64 // 8 <= len(fits) <= 64 // 8 + 2
    fits.clear()
    for model in (costs, fresh):
        model.observe(16, 1, 0.5, 0, 0.0)
    np.testing.assert_allclose(costs.verify(12, np.arange(1, 10)), fresh.verify(12, np.arange(1, 10)), rtol=0.05)
    assert fits


def constant(alpha_rows: np.ndarray, goes_on: np.ndarray | None = None):
    return lambda t: (np.ones_like(alpha_rows) if goes_on is None else goes_on, alpha_rows)


def linear(a: float, b: float):
    return lambda n, w: a + b * n * w


def tiled(b: float, tile: int, jump: float):
    """A verify pass that costs a jump once its width passes a tile, as on real hardware."""
    return lambda n, w: 1.0 + b * n * w + (jump if w > tile else 0.0)


MAX_K, N = 8, 8
SCENARIOS = {  # name: (per-row acceptance (N, MAX_K), verify(n, w), draft(n, k)); drafts always reach their offer
    "tile-at-4": (np.full((N, MAX_K), 0.9), tiled(0.01, 4, 2.0), lambda n, k: 0.02 * k),
    "low-alpha": (np.full((N, MAX_K), 0.3), linear(1.0, 0.0), lambda n, k: 0.2 * k),
    "acceptance-falls-at-position-4": (np.tile([0.95, 0.9, 0.85, 0.02, 0.02, 0.02, 0.02, 0.02], (N, 1)),
                                       linear(1.0, 0.02), lambda n, k: 0.02 * k),
    "mixed-rows": (np.repeat([[0.95], [0.05]], N // 2, axis=0).repeat(MAX_K, axis=1), tiled(0.02, 3, 1.5),
                   lambda n, k: 0.1 * k),
    "drafting-too-expensive": (np.full((N, MAX_K), 0.8), linear(1.0, 0.01), lambda n, k: 2.0 * k),
    "alpha-near-zero": (np.full((N, MAX_K), 0.01), linear(1.0, 0.05), lambda n, k: 0.01 * k),
}


@pytest.mark.parametrize("name", list(SCENARIOS))
def test_adaptive_k_converges_to_the_formulas_argmax(name):
    alpha, verify, draft = SCENARIOS[name]
    rates = true_rates(alpha, verify, draft, MAX_K)
    best = int(rates.argmax())
    assert np.sort(rates)[-2] < 0.93 * rates[best], "scenario must have a clear optimum"
    if name in ("drafting-too-expensive", "alpha-near-zero"):
        assert best == 0

    costs = SyntheticCosts(verify, draft)
    controller = AdaptiveK(MAX_K, N, costs=costs)
    trace = simulate(controller, constant(alpha), N, 700, verify, draft, np.random.default_rng(0))
    assert costs.observed == 700
    # it holds the best k, but for a step or two now and then re-checking a position it has not tried for a
    # while, and probing position 1 after a stretch at k = 0 (a draft model gets no free guesses)
    held = [int(h.max()) for h in trace.held[-300:]]
    assert all((h == h[0]).all() for h in trace.held[-300:]) and np.mean(np.array(held) == best) >= 0.9, (name, best)
    probes = [c for c in trace.chosen[-300:] if not c.any() and best > 0 or c.any() and best == 0]
    assert all((c == 1).all() for c in probes) and len(probes) <= 300 // controller.explore_every + 1
    # what it delivers, probes and re-checks included
    gains = true_rates(alpha, lambda n, w: 1.0, lambda n, k: 0.0, MAX_K)  # tokens per pass at k
    chosen = [int(c.max()) for c in trace.chosen[-300:]]
    assert sum(gains[k] for k in chosen) / sum(draft(N, k) + verify(N, k + 1) for k in chosen) >= 0.97 * rates[best]


@pytest.mark.parametrize("n,alpha,a,b,c", [(1, 0.8, 0.2, 0.01, 0.02), (32, 0.8, 0.2, 0.01, 0.02),
                                           (8, 0.8, 1.0, 0.02, 0.05), (8, 0.6, 1.0, 0.02, 0.05)])
def test_adaptive_k_is_near_the_best_fixed_k_on_flat_optima(n, alpha, a, b, c):
    """Where neighbouring k are within a few percent, the controller must deliver at least 0.97 of the best
    fixed k (the issue's goal), in expectation over the offers it chose after settling."""
    alpha_rows = np.full((n, MAX_K), alpha)
    verify, draft = linear(a, b), (lambda n, k: c * k)
    rates = true_rates(alpha_rows, verify, draft, MAX_K)
    controller = AdaptiveK(MAX_K, n, costs=SyntheticCosts(verify, draft))
    trace = simulate(controller, constant(alpha_rows), n, 800, verify, draft, np.random.default_rng(1))
    gains = true_rates(alpha_rows, lambda n, w: 1.0, lambda n, k: 0.0, MAX_K)  # tokens per pass at k
    settled = [int(o.max()) for o in trace.chosen[-400:]]
    assert all((o == o[0]).all() for o in trace.chosen[-400:]), "identical rows get one k"
    expected = sum(gains[k] for k in settled) / sum(draft(n, k) + verify(n, k + 1) for k in settled)
    assert expected >= 0.97 * rates.max()


@pytest.mark.parametrize("n", [1, 8])
def test_adaptive_k_recovers_after_a_phase_without_acceptance(n):
    """A draft model (no free guesses): alpha ~ 0 first, k falls to 0 but position 1 is probed now and then;
    then alpha ~ 0.9, and k rises again to a near-best value."""
    verify, draft = linear(1.0, 0.02), (lambda n, k: 0.05 * k)
    low, high = np.full((n, MAX_K), 0.02), np.full((n, MAX_K), 0.9)
    controller = AdaptiveK(MAX_K, n, costs=SyntheticCosts(verify, draft))
    rng = np.random.default_rng(2)
    trace = simulate(controller, constant(low), n, 300, verify, draft, rng)
    assert true_rates(low, verify, draft, MAX_K).argmax() == 0
    assert not np.any(trace.held[-150:])
    assert any(c.any() for c in trace.chosen[-150:]), "no probing at k = 0: speculation could never come back"
    trace = simulate(controller, constant(high), n, 500, verify, draft, rng)
    rates = true_rates(high, verify, draft, MAX_K)
    assert rates.argmax() >= 5
    rise = next(t for t, h in enumerate(trace.held) if h.any())
    assert rise <= controller.explore_every + 5, "too slow to come back"
    assert min(h.min() for h in trace.held[-100:]) >= 4


COPY = (np.array([0.9] + [0.97] * (MAX_K - 1)), np.full(MAX_K, 0.95))   # n-gram copying: a match, a long span
CHAT = (np.array([0.5] + [0.9] * (MAX_K - 1)), np.full(MAX_K, 0.1))     # open text: junk matches half the time


def phases(n: int, copying: dict[int, tuple[int, int]]):
    """Row r copies during steps [start, stop) of copying[r], else writes open text."""
    def at(t):
        rows = [COPY if start <= t < stop else CHAT for start, stop in (copying.get(r, (0, 0)) for r in range(n))]
        return np.array([g for g, _ in rows]), np.array([a for _, a in rows])
    return at


CPU = (linear(1.0, 0.03), lambda n, k: 0.01 * k)   # a column of 4 rows costs 12% of a pass (a CPU)


@pytest.mark.parametrize("seed", range(6))
def test_a_row_follows_its_copy_span_within_a_few_steps(seed):
    """Row 0 starts copying at step 150 and stops at 300 among rows that never copy (an n-gram drafter: free
    one-token guesses when nobody drafts). Judged by the true rate of the offers it holds against the best
    offers for the current phase: it must get within 10% of the best within a bounded number of steps of
    either switch, and stay near the best between switches."""
    n, verify, draft = 4, *CPU
    widths = [verify(n, w) for w in range(1, MAX_K + 2)]
    base, column = widths[0], np.diff(widths) + draft(n, 1)
    trace_at = phases(n, {0: (150, 300)})

    def quality(t: int, held: np.ndarray) -> float:
        goes_on, accept = trace_at(t)
        reach = np.cumprod(goes_on, 1)
        gain = reach * np.cumprod(accept, 1)
        return pass_rates(held, gain, reach, base, column) / best_offers(gain, reach, base, column)[1]

    for t, best in [(0, [0, 0, 0, 0]), (200, [8, 1, 1, 1])]:  # the scenario: nobody drafts, then row 0 drafts long
        goes_on, accept = trace_at(t)
        reach = np.cumprod(goes_on, 1)
        assert best_offers(reach * np.cumprod(accept, 1), reach, base, column)[0].tolist() == best
    controller = AdaptiveK(MAX_K, n, costs=SyntheticCosts(verify, draft))
    trace = simulate(controller, trace_at, n, 450, verify, draft, np.random.default_rng(seed), shadow=True)
    q = np.array([quality(t, held) for t, held in enumerate(trace.held)])
    rise = next(t for t in range(150, 300) if q[t] >= 0.9) - 150
    fall = next(t for t in range(300, 450) if q[t] >= 0.9) - 300
    assert rise <= 20 and fall <= 15, (rise, fall)
    assert q[100:150].mean() >= 0.99 and q[150 + rise : 300].mean() >= 0.95 and q[300 + fall :].mean() >= 0.97


@pytest.mark.parametrize("name,n,goes_on,accept,costs", [
    ("copy-and-chat", 4, np.array([COPY[0], CHAT[0], CHAT[0], CHAT[0]]), np.array([COPY[1], CHAT[1], CHAT[1], CHAT[1]]), CPU),
    ("near-tie-one-row", 1, np.ones((1, MAX_K)), np.full((1, MAX_K), 0.7), (linear(1.0, 0.03), lambda n, k: 0.1 * k)),
    ("near-tie-batch", 8, np.ones((8, MAX_K)), np.full((8, MAX_K), 0.6), (linear(1.0, 0.02), lambda n, k: 0.05 * k)),
    ("chat-only", 16, np.tile(CHAT[0], (16, 1)), np.tile(CHAT[1], (16, 1)), CPU),
])
def test_no_flapping_on_stationary_traces(name, n, goes_on, accept, costs):
    """Stationary acceptance, random outcomes, neighbouring plans near ties: the held offers may settle on any
    near-best plan but must not switch back and forth, and what they deliver stays near the best. A single
    row is the noisiest case (its own few outcomes are all the evidence there is)."""
    verify, draft = costs
    controller = AdaptiveK(MAX_K, n, costs=SyntheticCosts(verify, draft))
    trace = simulate(controller, constant(accept, goes_on), n, 1300, verify, draft, np.random.default_rng(5),
                     shadow=goes_on.min() < 1)
    changes, flaps = len(trace.changes(start=300)), trace.flaps(start=300)
    # one row near a tie: 7-14 changes in 1000 steps over most seeds, about 30 on the worst (this one)
    assert changes <= (35 if n == 1 else 5) and flaps <= (10 if n == 1 else 1), (changes, flaps)
    reach = np.cumprod(goes_on, 1)
    widths = [verify(n, w) for w in range(1, MAX_K + 2)]
    base, column = widths[0], np.diff(widths) + draft(n, 1)
    best = best_offers(reach * np.cumprod(accept, 1), reach, base, column)[1]
    held = np.array([pass_rates(h, reach * np.cumprod(accept, 1), reach, base, column) for h in trace.held[300:]])
    assert held.mean() >= 0.97 * best and np.quantile(held, 0.1) >= 0.9 * best


def test_default_cost_model_learns_synthetic_times():
    """No injection: the controller's own CostModel learns verify and draft times from the StepRecords
    (a + b*n + c*n*w and a per-column draft time) and the controller then finds the argmax."""
    verify, draft = linear(1.0, 0.02), (lambda n, k: 0.05 * k)
    alpha = np.full((N, MAX_K), 0.3)
    rates = true_rates(alpha, verify, draft, MAX_K)
    best = int(rates.argmax())
    assert best > 0 and np.sort(rates)[-2] < 0.93 * rates[best]
    controller = AdaptiveK(MAX_K, N)
    trace = simulate(controller, constant(alpha), N, 600, verify, draft, np.random.default_rng(7))
    costs = controller.costs
    assert isinstance(costs, CostModel)
    costs.stale_after = None   # what the cells learnt, however long ago (a stale cell is not priced: another test)
    for width in (1, 2, 3):
        assert costs.verify(N, width) == pytest.approx(verify(N, width), rel=0.02)
    assert costs.draft(N, 3) == pytest.approx(draft(N, 3), rel=0.02)
    held = np.array([k for h in trace.held[-200:] for k in h])
    assert np.mean(held == best) >= 0.95   # the rest: a stale width tried again (CostModel.stale_after)



def lifted(hits: np.ndarray, tries: np.ndarray, first: float, chain: float, prior: np.ndarray) -> np.ndarray:
    """One level's estimates (n, 2, K) under a prior per position (n, 2, K), with plain loops in log-odds: position
    j's prior is the prior's at j lifted by as much as the estimate beat the prior at j - 1 (probabilities
    clipped to [0.001, 0.999] before a logit)."""
    def logit(p):
        p = min(max(p, 1e-3), 1 - 1e-3)
        return np.log(p / (1 - p))

    out = np.empty_like(hits)
    for r, e in itertools.product(range(hits.shape[0]), range(2)):
        lift = 0.0
        for j in range(hits.shape[2]):
            before = 1 / (1 + np.exp(-(logit(prior[r, e, j]) + lift)))
            m = first if j == 0 else chain
            out[r, e, j] = (hits[r, e, j] + m * before) / (tries[r, e, j] + m)
            lift = logit(out[r, e, j]) - logit(prior[r, e, j])
    return out


def one_step(offered: np.ndarray, drafted: np.ndarray, accepted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Estimates.observe's (hits, tries) of a single step."""
    return tuple(counts[None] for counts in trials(offered, drafted, accepted, MAX_K))


def test_trials_count_each_position_as_defined():
    """Position j is tried for reach when offered and j - 1 was drafted, hit when drafted; tried for acceptance
    when drafted and j - 1 was accepted, hit when accepted: every (offered, drafted, accepted) of max_k = 3,
    one at a time and as a batch."""
    k = 3
    triples = [(o, d, a) for o in range(k + 1) for d in range(o + 1) for a in range(d + 1)]
    hits, tries = trials(*np.array(triples).T, k)
    for (o, d, a), hit, tried in zip(triples, hits, tries):
        for j in range(1, k + 1):
            assert tried[REACH, j - 1] == (o >= j and d >= j - 1) and hit[REACH, j - 1] == (o >= j and d >= j)
            assert tried[ACCEPT, j - 1] == (d >= j and a >= j - 1) and hit[ACCEPT, j - 1] == (d >= j and a >= j)
        one = trials(np.array(o), np.array(d), np.array(a), k)
        assert (one[0] == hit).all() and (one[1] == tried).all()


def test_levels_chain_the_worker_the_slow_and_the_fast_scale():
    """The worker's pooled level under the drafter's prior, the slow scale under the worker's, the fast under the
    slow one's: the one loop over anti-diagonals gives what the definition gives level by level."""
    rng = np.random.default_rng(6)
    n, prior = 3, np.array([[0.6] + [0.95] * (MAX_K - 1), [0.35] + [0.8] * (MAX_K - 1)])
    est = Estimates(n, MAX_K, (0.7, 0.98), (0.5, 2.0), 4.0, pooled=(0.99, 2.0))
    for _ in range(25):
        offered = rng.integers(0, MAX_K + 1, n)
        drafted = np.minimum(offered, rng.integers(0, MAX_K + 1, n))
        est.observe(*one_step(offered, drafted, np.minimum(drafted, rng.integers(0, MAX_K + 1, n))), prior)
    pooled = lifted(np.repeat(est.pooled_hits[0], n, 0), np.repeat(est.pooled_tries[0], n, 0), 2.0, 4.0,
                    np.broadcast_to(prior, (n, 2, MAX_K)))
    slow = lifted(est.hits[1, :n], est.tries[1, :n], 2.0, 4.0, pooled)
    fast = lifted(est.hits[0, :n], est.tries[0, :n], 0.5, 4.0, slow)
    np.testing.assert_allclose(est.levels(n, prior).transpose(0, 2, 3, 1), np.stack([pooled, slow, fast]), rtol=1e-9)
    np.testing.assert_allclose(est.scales(n, prior), np.stack([fast, slow]), rtol=1e-9)


def test_one_prior_for_every_position_chains_each_position_from_the_one_before():
    """With a single prior, the slow scale's prior at position j is its own estimate at j - 1 (the chain)."""
    rng = np.random.default_rng(3)
    est = Estimates(4, MAX_K, (0.9,), (2.0,), chain_tries=4.0)
    for _ in range(20):
        offered = rng.integers(0, MAX_K + 1, 4)
        drafted = np.minimum(offered, rng.integers(0, MAX_K + 1, 4))
        est.observe(*one_step(offered, drafted, np.minimum(drafted, rng.integers(0, MAX_K + 1, 4))),
                    np.array([0.6, 0.35]))
    out = est.scales(4, np.array([0.6, 0.35]))[-1]
    before = np.array([0.6, 0.35])
    for j in range(MAX_K):
        m = 2.0 if j == 0 else 4.0
        before = (est.hits[-1, :, :, j] + m * before) / (est.tries[-1, :, :, j] + m)
        np.testing.assert_allclose(out[:, :, j], before, rtol=1e-6)


def random_steps(rng: np.random.Generator, n: int, steps: int) -> list[tuple[np.ndarray, np.ndarray]]:
    """One-step (hits, tries) of random drafts of n rows."""
    out = []
    for _ in range(steps):
        offered = rng.integers(0, MAX_K + 1, n)
        drafted = np.minimum(offered, rng.integers(0, MAX_K + 1, n))
        out.append(one_step(offered, drafted, np.minimum(drafted, rng.integers(0, MAX_K + 1, n))))
    return out


def test_steps_counted_together_give_the_counts_of_steps_counted_one_by_one():
    """A controller that holds k = 0 counts the steps since its last plan at once: the decayed counts (rows'
    and pooled) are exactly those of counting them one by one; only the scales' weights are judged by the
    estimates as they stood before the first of them."""
    rng, prior = np.random.default_rng(8), np.array([[0.6] * MAX_K, [0.35] * MAX_K])
    one_by_one, together = (Estimates(5, MAX_K, (0.7, 0.98), (0.5, 2.0), 4.0, pooled=(0.99, 2.0)) for _ in range(2))
    for est in (one_by_one, together):
        for hits, tries in random_steps(np.random.default_rng(1), 5, 10):
            est.observe(hits, tries, prior)
    steps = random_steps(rng, 5, 6)
    for hits, tries in steps:
        one_by_one.observe(hits, tries, prior)
    together.observe(np.concatenate([h for h, _ in steps]), np.concatenate([t for _, t in steps]), prior)
    for field in ("hits", "tries", "pooled_hits", "pooled_tries"):
        np.testing.assert_allclose(getattr(together, field), getattr(one_by_one, field), rtol=1e-12)
    np.testing.assert_allclose(together.weight, one_by_one.weight, atol=0.1)
    np.testing.assert_allclose(together.mixed(5, prior), one_by_one.mixed(5, prior), atol=0.02)


def test_admitting_and_moving_rows_keep_the_cached_estimates_exact():
    """Rows admitted and moved patch the estimates cached for the step instead of recomputing them: the
    patched cache equals a fresh computation."""
    rng, prior = np.random.default_rng(5), np.array([[0.6] + [0.95] * (MAX_K - 1), [0.35] + [0.8] * (MAX_K - 1)])
    est = Estimates(6, MAX_K, (0.7, 0.98), (0.5, 2.0), 4.0, pooled=(0.99, 2.0))
    for t, (hits, tries) in enumerate(random_steps(rng, 6, 30)):
        est.observe(hits, tries, prior)
        est.levels(6, prior)
        est.reset(2 + t % 3, 2)
        est.move(5, t % 5)
        patched = est.levels(6, prior).copy()
        est._last = None
        np.testing.assert_allclose(patched, est.levels(6, prior), rtol=1e-12, atol=1e-15)


def test_a_compute_bound_batch_holds_k0_and_plans_every_few_steps_but_still_finds_a_copying_batch():
    """Where a further column costs 0.8 of a plain pass (a compute-bound batch of 16), open text never pays:
    the controller holds k = 0 and plans on a fraction of the steps. When every row starts to copy (drafts
    nearly always accepted), it drafts within a few steps of a controller that plans every step."""
    verify, draft = linear(1.0, 0.3), (lambda n, k: 0.001 * k)
    chat, copy = (np.full((16, MAX_K), 0.3), np.full((16, MAX_K), 0.3)), (np.ones((16, MAX_K)), np.full((16, MAX_K), 0.99))

    def run(max_hold: int) -> tuple[int, int]:
        """(plans in the open-text phase, the step at which drafting starts)"""
        controller = AdaptiveK(MAX_K, 16, costs=SyntheticCosts(verify, draft), prior=COPY_PRIOR, max_hold=max_hold,
                               max_coast=1 if max_hold == 0 else 8)
        trace, plans, model = Trace([], []), [], controller.model
        controller.model = lambda n: plans.append(len(trace.chosen)) or model(n)
        simulate(controller, lambda t: chat if t < 200 else copy, 16, 240, verify, draft, np.random.default_rng(0),
                 shadow=True, trace=trace)
        return sum(t < 200 for t in plans), next(t for t, chosen in enumerate(trace.chosen) if chosen.any())

    (held_plans, held_start), (every_plans, every_start) = run(32), run(0)
    assert every_plans >= 200 - 1 and held_plans <= 200 / 16
    assert 200 < every_start <= held_start <= every_start + 3



def test_a_compute_bound_hold_outlasts_rows_doing_a_little_better_than_planned_but_not_a_copy_span():
    """Holding k = 0 where drafting would need the gains to grow `needed`-fold, the controller keeps holding
    while the rows' shadow guesses hit a third more often than the plan expected (its estimates lag; at
    batch 16 such noise ended most holds), and plans again within a few steps once every row hits."""
    verify, draft = linear(1.0, 0.3), (lambda n, k: 0.001 * k)
    controller = AdaptiveK(MAX_K, 16, costs=SyntheticCosts(verify, draft))
    assert not controller.choose(16).any() and controller.coast == controller.max_hold
    expected = np.array([row[1] for row in controller.expected[:16]])
    assert controller.tolerance > 0.4, controller.tolerance       # needed > 1.8: a third more cannot pay

    def shadow_step(hits: np.ndarray) -> None:
        offers = controller.choose(16)
        controller.observe(StepRecord(np.ones(16, dtype=int), np.ones(16, dtype=int), hits, 1, 0.0, verify(16, 1)))
        assert not offers.any()

    rng = np.random.default_rng(0)
    for _ in range(controller.max_hold - 2):
        shadow_step((rng.random(16) < 4 / 3 * expected).astype(int))
    assert controller.coast > 0
    for step in range(1, 4):
        shadow_step(np.ones(16, dtype=int))
        if controller.coast == 0:
            break
    assert controller.coast == 0 and step <= 2


def test_where_columns_are_cheap_the_controller_plans_every_few_steps_and_never_holds_long():
    """A memory-bound pass (a further column costs 5 % of a plain one): a row whose drafts are never accepted
    gets a plan at least every `max_coast` steps (every step with max_coast=1), since its acceptance can
    grow many-fold in a step and drafting is nearly free; treated as compute-bound, the same controller holds
    k = 0 for up to `max_hold` steps at a time."""
    verify, draft = linear(1.0, 0.05), (lambda n, k: 0.0001 * k)

    def plans(hold_share: float, max_coast: int) -> list[int]:
        controller = AdaptiveK(MAX_K, 1, costs=SyntheticCosts(verify, draft), prior=COPY_PRIOR, hold_share=hold_share,
                               max_coast=max_coast)
        trace, counted, model = Trace([], []), [], controller.model
        controller.model = lambda n: counted.append(len(trace.chosen)) or model(n)
        never = (np.full((1, MAX_K), 0.5), np.zeros((1, MAX_K)))
        simulate(controller, lambda t: never, 1, 99, verify, draft, np.random.default_rng(2), shadow=True, trace=trace)
        return counted

    coasting = plans(0.2, 8)
    assert len(plans(0.2, 1)) == 99 and 99 / 8 <= len(coasting) <= 99 / 3
    assert max(np.diff(coasting + [99])) <= 8 and len(plans(0.0, 1)) < 90


def test_a_steady_batch_plans_every_few_steps_and_still_follows_a_copy_span_as_fast():
    """Batch 1, columns cheap: while plans keep the held offers the controller coasts longer and longer between
    them, and a row that starts to copy at step 150 drafts within two steps of a controller that plans every
    step (its first accepted guess ends the coast). A lone row coasts the same while it drains (its drain
    weight is 1 whatever it has left)."""
    verify, draft = linear(1.0, 0.02), (lambda n, k: 0.001 * k)
    trace_at = phases(1, {0: (150, 300)})

    def run(max_coast: int, draining: bool = False) -> tuple[int, int]:
        """(plans before the copy span, the first step from 150 on whose offer reaches 4 positions)"""
        controller = AdaptiveK(MAX_K, 1, costs=SyntheticCosts(verify, draft), max_coast=max_coast)
        if draining:
            choose = controller.choose
            controller.choose = lambda n, remaining=None: choose(n, np.full(n, 50))
        trace, plans, model = Trace([], []), [], controller.model
        controller.model = lambda n: plans.append(len(trace.chosen)) or model(n)
        simulate(controller, trace_at, 1, 200, verify, draft, np.random.default_rng(4), shadow=True, trace=trace)
        return sum(t < 150 for t in plans), next(t for t in range(150, 200) if trace.chosen[t][0] >= 4)

    (every_plans, every_start), (steady_plans, steady_start) = run(1), run(8)
    assert every_plans == 150 and steady_plans < 150 / 3
    assert every_start <= steady_start <= every_start + 2
    assert run(8, draining=True) == (steady_plans, steady_start)


def cold_start_rate(prior, alpha_row: np.ndarray, steps: int, seeds: int = 40) -> float:
    """Tokens per second over the first `steps` steps of one row, columns nearly free (batch 1), averaged
    over simulated runs."""
    verify, draft = linear(1.0, 0.01), (lambda n, k: 0.005 * k)
    tokens = seconds = 0.0
    for seed in range(seeds):
        trace = simulate(AdaptiveK(MAX_K, 1, costs=SyntheticCosts(verify, draft), prior=prior),
                         constant(alpha_row[None]), 1, steps, verify, draft, np.random.default_rng(seed), shadow=True)
        tokens, seconds = tokens + trace.tokens, seconds + trace.seconds
    return tokens / seconds


def test_a_copying_drafters_prior_drafts_deep_as_soon_as_a_row_matches():
    """A copied span: position 1 as likely as the prior says, the span's next tokens nearly always. With
    COPY_PRIOR the cold controller reaches the span's depth within the first steps; with one prior for every
    position it climbs one position at a time. Where deep positions are as poor as the first, it costs
    next to nothing."""
    span, flat = np.array([0.5] + [0.95] * (MAX_K - 1)), np.full(MAX_K, 0.3)
    assert cold_start_rate(COPY_PRIOR, span, 6) > 1.08 * cold_start_rate(DEFAULT_PRIOR, span, 6)
    assert cold_start_rate(COPY_PRIOR, flat, 6) > 0.97 * cold_start_rate(DEFAULT_PRIOR, flat, 6)


def test_a_copying_drafters_prior_still_finds_the_best_k_where_deep_positions_fail():
    """Where the deep positions are as poor as the first, the copy prior costs a few early steps, then the
    controller holds the best k like the default one."""
    verify, draft = linear(1.0, 0.02), (lambda n, k: 0.05 * k)
    alpha = np.full((N, MAX_K), 0.3)
    best = int(true_rates(alpha, verify, draft, MAX_K).argmax())
    controller = AdaptiveK(MAX_K, N, costs=SyntheticCosts(verify, draft), prior=COPY_PRIOR)
    trace = simulate(controller, constant(alpha), N, 600, verify, draft, np.random.default_rng(7))
    held = [int(h.max()) for h in trace.held[-200:]]
    assert np.mean(np.array(held) == best) >= 0.9

# ------------------------------------------------------------------------------------ confidence stops

def test_draft_stop_cuts_where_the_offered_rows_expect_less_than_a_column_costs():
    confidence = torch.tensor([[0.9, 0.9, 0.9, 0.9], [0.9, 0.5, 0.9, 0.9], [0.2, 0.9, 0.9, 0.9]])
    stop = DraftStop(np.array([0.5, 1.0, 1.2, 1.2]))
    # expected accepted per column: 2.0, 1.44, 1.296, 1.166 -> the fourth column does not pay
    assert stop.cut(confidence, torch.tensor([4, 4, 4])).tolist() == [3, 3, 3]
    # rows not offered a column do not count towards it: 0.729 + 0.405 < 1.2, 0.81 + 0.18 < 1.0
    assert stop.cut(confidence, torch.tensor([4, 4, 2])).tolist() == [2, 2, 2]
    assert stop.cut(confidence, torch.tensor([4, 1, 4])).tolist() == [1, 1, 1]
    # a calibration of 0.5 (the drafter is twice as sure as it is right) halves each column's reach
    assert DraftStop(np.array([0.5, 1.0, 1.2, 1.2]), calibration=0.5).cut(confidence, torch.tensor([4, 4, 4])).tolist() == [1, 1, 1]
    # while draining, a row counts by its weight (the rate's own units): 0.81 + 0.5 * 0.45 >= 1.0 but
    # 0.729 + 0.5 * 0.405 < 1.2 (the third row, weight 0, counts for nothing)
    weighted = DraftStop(np.array([0.5, 1.0, 1.2, 1.2]), weight=np.array([1.0, 0.5, 0.0]))
    assert weighted.cut(confidence, torch.tensor([4, 4, 4])).tolist() == [2, 2, 2]


def test_a_whole_proposal_is_cut_where_its_columns_together_pay_most():
    """A costly first column (a wider pass changing kernels) is kept when the columns after it make up for it:
    0.3 - 0.5 < 0, but + 0.27 - 0.05 + 0.243 - 0.05 > 0. A drafter drafting column by column cannot see that."""
    stop = DraftStop(np.array([0.5, 0.05, 0.05, 0.5]))
    confidence = torch.tensor([[0.3, 0.9, 0.9, 0.9]])
    assert stop.cut(confidence, torch.tensor([4])).tolist() == [3]
    assert stop.cut(confidence, torch.tensor([1])).tolist() == [0]
    assert not stop.keep(0, torch.tensor([0.3], dtype=torch.float64), torch.tensor([True]))


def test_adaptive_k_calibrates_confidence_and_stops_at_its_predicted_rate():
    """The stop's threshold is the held plan's predicted rate times each column's cost, and its calibration
    is accepted drafts per unit of confidence the drafter claimed."""
    verify, draft = linear(1.0, 0.02), (lambda n, k: 0.05 * k)
    n, rng = 4, np.random.default_rng(3)
    controller = AdaptiveK(MAX_K, n, costs=SyntheticCosts(verify, draft), max_coast=1)   # the last choose plans
    for _ in range(400):
        offers = controller.choose(n)
        confidence = np.full((n, MAX_K), 0.8)
        accepted = (np.cumprod(rng.random((n, MAX_K)) < 0.4, 1) * (np.arange(MAX_K) < offers[:, None])).sum(1)
        width = int(offers.max())
        controller.observe(StepRecord(offers, offers, accepted, width + 1, draft(n, width), verify(n, width + 1),
                                      confidence[:, :width]))
    controller.choose(n)
    stop = controller.draft_stop()
    assert stop.calibration == pytest.approx(0.4 / 0.8, rel=0.1)
    gain, reach = controller.model(n)
    widths = [verify(n, w) for w in range(1, MAX_K + 2)]
    column = np.diff(widths) + draft(n, 1)
    rate = pass_rates(controller.held[:n], gain, reach, widths[0], column)
    assert stop.threshold == pytest.approx(rate * column)


def test_calibration_counts_the_positions_the_target_judged_as_the_trials_define_them():
    """Drafts cut short, rejected early, or reported without confidence (NaN): each step's calibration counts,
    of the ACCEPT trials (workers/engine/acceptance.py: trials), the hits and the confidence claimed."""
    n, rng = 6, np.random.default_rng(7)
    controller = AdaptiveK(MAX_K, n, costs=CostModel())
    expected = np.array([1.0, 1.0])
    for _ in range(50):
        offered = rng.integers(0, MAX_K + 1, n)
        drafted = rng.integers(0, offered + 1)
        accepted = rng.integers(0, drafted + 1)
        width = int(drafted.max())
        confidence = rng.random((n, width))
        confidence[rng.random((n, width)) < 0.2] = np.nan
        controller.observe(StepRecord(offered, drafted, accepted, width + 1, 0.0, 0.01, confidence))
        hits, tries = trials(offered, drafted, accepted, MAX_K)
        judged = tries[:, ACCEPT, :width].astype(bool) & ~np.isnan(confidence)
        expected = 0.99 * expected + [hits[:, ACCEPT, :width][judged].sum(), confidence[judged].sum()]
    assert controller.confidence == pytest.approx(tuple(expected))


class Staggered(Controller):
    """Offers that differ per row and change every step, 0..max_k, as a per-row controller may."""

    def __init__(self, max_k: int):
        self.max_k, self.steps, self.records = max_k, 0, []

    def choose(self, n_rows: int, remaining: np.ndarray | None = None) -> np.ndarray:
        self.steps += 1
        return (np.arange(n_rows) * 2 + self.steps) % (self.max_k + 1)

    def observe(self, step: StepRecord) -> None:
        self.records.append(step)


@pytest.mark.parametrize("drafter_name", ["none", "ngram", "model", "synthetic"])
def test_greedy_with_per_row_lengths_equals_transformers_generate(tok, target, draft, prompt_ids, references, drafter_name):
    controller = Staggered(GEN_MAX_K)
    drafter = make_drafter(drafter_name, draft, references, prompt_ids, len(tok))
    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, drafter, controller,
                                     GenerationSettings(max_new_tokens=GEN_MAX_NEW, max_k=GEN_MAX_K, batch_size=3))
    result = generator.generate(requests_for(prompt_ids))
    assert [c.token_ids for c in result.completions] == references
    widths = set()
    for step in controller.records:
        assert (step.drafted <= step.offered).all() and (step.accepted <= step.drafted).all()
        widths.add(len(set(step.offered.tolist())))
    assert max(widths) > 1, "rows were never offered different lengths"
    if drafter_name in ("model", "synthetic"):
        assert result.stats.accepted_tokens > 0


@pytest.mark.parametrize("drafter_name", ["ngram", "model"])
def test_greedy_with_the_adaptive_controller_equals_transformers_generate(tok, target, draft, prompt_ids, references,
                                                                          drafter_name):
    drafter = make_drafter(drafter_name, draft, references, prompt_ids, len(tok))
    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, drafter, AdaptiveK(GEN_MAX_K, 3),
                                     GenerationSettings(max_new_tokens=GEN_MAX_NEW, max_k=GEN_MAX_K, batch_size=3))
    assert [c.token_ids for c in generator.generate(requests_for(prompt_ids)).completions] == references


class Stopping(FixedK):
    """A fixed k with a confidence stop."""

    def __init__(self, k: int, stop: DraftStop):
        super().__init__(k)
        self.stop, self.records = stop, []

    def draft_stop(self) -> DraftStop:
        return self.stop

    def observe(self, step: StepRecord) -> None:
        self.records.append(step)


def test_model_drafter_stops_early_on_low_confidence_and_stays_lossless(tok, target, draft, prompt_ids, references):
    """A stop that lets two columns through: the draft model runs three passes a step instead of four (the
    third reveals the stop), drafts at most two tokens a row, and the output is still transformers' own."""
    runs = {}
    for name, controller in [("fixed", Stopping(4, None)), ("stop", Stopping(4, DraftStop(np.array([0.0, 0.0, np.inf, np.inf]))))]:
        generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, ModelDrafter(DecodingModel.prepare(draft), GREEDY),
                                         controller, GenerationSettings(max_new_tokens=GEN_MAX_NEW, max_k=4, batch_size=3))
        result = generator.generate(requests_for(prompt_ids))
        assert [c.token_ids for c in result.completions] == references
        runs[name] = (result.stats, controller.records)
    stats, records = runs["stop"]
    drafting = [r for r in records if r.width > 1]
    assert all(r.drafted.max() <= 2 and r.confidence.shape[1] == r.drafted.max() for r in drafting)
    full = sum(int(r.offered.max()) >= 3 for r in drafting)
    assert full > 0 and stats.draft_passes == sum(min(int(r.offered.max()), 3) for r in drafting)
    assert stats.draft_passes < runs["fixed"][0].draft_passes
    assert stats.accepted_tokens > 0


def test_adaptive_generators_over_the_same_models_share_measured_costs(model_dir):
    """Pass costs are facts of the models on this device: every adaptive generator built over the same loaded
    models (a worker's shards, the bench's runs) keeps one cost table; fixed k measures nothing."""
    config = make_config(model_dir, "in.jsonl", "out", speculation={"k": "adaptive", "max_k": 3})
    models = load_models(config, torch.device("cpu"))
    first, second = make_generator(config, models), make_generator(config, models)
    first.generate([Request("a", [5, 6, 7, 8, 5, 6, 7], 0)])
    assert second.controller.costs is first.controller.costs is models.costs and models.costs.cells
    fixed = make_generator(make_config(model_dir, "in.jsonl", "out", speculation={"k": 2}), models)
    cells = dict(models.costs.cells)
    fixed.generate([Request("b", [9, 10, 11], 0)])
    assert isinstance(fixed.controller, FixedK) and models.costs.cells == cells


def test_a_width_measured_long_ago_is_not_believed_and_is_measured_afresh():
    """A width measured once under a passing load is priced high; a controller then never tries it again. Once
    its cell is `stale_after` passes old it drops out of the prices (here back to the optimistic prior of a
    width-1 pass plus 10 % a column), and its next measurement starts the cell again instead of being
    averaged with the stale one."""
    costs, kept = CostModel(stale_after=50), CostModel(stale_after=None)
    for model in (costs, kept):
        model.observe(1, 2, 5.0, 1, 0.0)
        for _ in range(60):
            model.observe(1, 1, 1.0, 0, 0.0)
    assert kept.verify(1, 2) == pytest.approx(5.0)
    assert costs.verify(1, 2) == pytest.approx(1.1)
    costs.observe(1, 2, 1.2, 1, 0.0)
    assert costs.verify(1, 2) == pytest.approx(1.2)


def test_a_batch_that_shrinks_while_the_controller_coasts_ends_the_coast():
    """The last slot retiring needs no move, so the controller sees fewer rows without being told: a batch that
    drafts plans afresh instead of comparing the rows with the plan's (a batch-16 bench run failed on it)."""
    verify, draft = linear(1.0, 0.02), (lambda n, k: 0.001 * k)
    controller = AdaptiveK(MAX_K, 3, costs=SyntheticCosts(verify, draft))
    for _ in range(200):
        offers = controller.choose(3)
        controller.observe(StepRecord(offers, offers, offers, int(offers.max()) + 1, 0.0, verify(3, int(offers.max()) + 1)))
        if controller.coast >= 2:
            break
    assert controller.coast >= 2
    offers = controller.choose(2)
    controller.observe(StepRecord(offers, offers, np.zeros(2, dtype=int), int(offers.max()) + 1, 0.0, 1.0))
    assert controller.coast == 0 and len(controller.choose(2)) == 2
