"""Sampling is lossless: speculative sampling leaves the target's distribution exactly as it is, under both
couplings of a sampling draft with the target (invariant: shared Gumbel noise; rejection: Leviathan's rule).

Oracles: transformers' own logits warpers (temperature, top-k, top-p, in that order) for the filtered
distribution, and the exact joint distribution of the first tokens, enumerated with the target's
plain (uncached) forward. Empirical frequencies over many seeds must pass a chi-square test; the same
test must reject deliberately wrong samplers (accepting every draft; skipping the residual; dropping the
shared noise; reusing one position's noise at every position), so the bound has teeth.
"""
from __future__ import annotations

import itertools
from dataclasses import replace

import numpy as np
import pytest
import torch
from transformers.generation.logits_process import (
    LogitsProcessorList,
    TemperatureLogitsWarper,
    TopKLogitsWarper,
    TopPLogitsWarper,
)

import workers.engine.generator as generator_module
import workers.engine.sampling as sampling_module
from tests.tiny_models import StubTokenizer, tiny_draft, tiny_llama
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.drafter import Drafter, pack
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.model_drafter import ModelDrafter
from workers.engine.mtp_drafter import MTPDrafter
from workers.engine.suffix_drafter import SuffixDrafter
from workers.engine.sampling import (
    SamplingParams,
    Verdict,
    inverse_cdf,
    probabilities,
    uniforms,
    verify_sampled,
)
from workers.mtp_head import HeadSpec, MTPHead

V = 12
PROMPT = [1, 5, 7, 3]
P_MIN = 1e-5  # chi-square p-value below which a sampler is declared wrong
PARAMS = [SamplingParams(0.7, top_k=6), SamplingParams(1.3, top_p=0.8), SamplingParams(0.8, top_k=8, top_p=0.9)]
COUPLINGS = ["invariant", "rejection"]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


# ----------------------------------------------------------------------------------------------- oracles

def hf_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """transformers' warpers, in the order its generate() applies them, then softmax."""
    processors = LogitsProcessorList()
    if params.temperature != 1.0:
        processors.append(TemperatureLogitsWarper(params.temperature))
    if params.top_k:
        processors.append(TopKLogitsWarper(params.top_k))
    if params.top_p < 1.0:
        processors.append(TopPLogitsWarper(params.top_p))
    flat = logits.reshape(-1, logits.shape[-1])
    scores = processors(torch.zeros(flat.shape[0], 1, dtype=torch.long), flat.clone())
    return scores.softmax(-1).reshape(logits.shape)


def exact_distributions(model, params: SamplingParams) -> tuple[np.ndarray, np.ndarray]:
    """The exact joint of the first two sampled tokens (V, V) and the marginal of the third (V,),
    by enumerating every prefix through the model's own full forward pass (no KV cache)."""
    with torch.no_grad():
        p1 = hf_probs(model(torch.tensor([PROMPT])).logits[0, -1].double(), params)
        firsts = torch.tensor([PROMPT + [a] for a in range(V)])
        p2 = hf_probs(model(firsts).logits[:, -1].double(), params)
        pairs = torch.tensor([PROMPT + [a, b] for a in range(V) for b in range(V)])
        p3 = hf_probs(model(pairs).logits[:, -1].double(), params).reshape(V, V, V)
    joint = p1[:, None] * p2
    third = torch.einsum("ab,abc->c", joint, p3)
    return joint.numpy(), third.numpy()


def chi_square_pvalue(counts: np.ndarray, probs: np.ndarray) -> float:
    """Pearson's test of observed counts against exact probabilities. Cells expecting fewer than 5
    observations are pooled; cells of probability zero must stay empty."""
    counts, probs = counts.ravel().astype(float), probs.ravel()
    if counts[probs <= 0].sum() > 0:
        return 0.0  # an impossible outcome was drawn
    n = counts.sum()
    expected = n * probs
    big = expected >= 5
    obs = np.append(counts[big], counts[~big & (probs > 0)].sum())
    exp = np.append(expected[big], expected[~big & (probs > 0)].sum())
    if exp[-1] < 5:  # merge a too-small pooled cell into the smallest big one
        smallest = int(np.argmin(exp[:-1]))
        obs[smallest] += obs[-1]
        exp[smallest] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = float(((obs - exp) ** 2 / exp).sum())
    dof = len(exp) - 1
    return float(torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                         torch.tensor(stat / 2, dtype=torch.float64)))


# ------------------------------------------------------------------------------- deliberately wrong samplers

def accept_everything(logits, drafts, draft_lens, params, seeds, positions, draft_probs=None) -> Verdict:
    """Wrong: keeps every draft, then samples one token from the target."""
    probs = probabilities(logits, params)
    u = uniforms(seeds, positions, probs.shape[1], stream=0)
    lens = draft_lens.tolist()
    nxt = [int(inverse_cdf(probs[r, a : a + 1], u[r, a : a + 1])) for r, a in enumerate(lens)]
    return Verdict(draft_lens.cpu(), [drafts[r, :a].tolist() + [nxt[r]] for r, a in enumerate(lens)])


def skip_residual(logits, drafts, draft_lens, params, seeds, positions, draft_probs=None) -> Verdict:
    """Wrong: accepts with min(1, p/q) (q one-hot for a deterministic draft) but on rejection draws from
    p itself instead of norm(max(p - q, 0))."""
    probs = probabilities(logits, params)
    k = drafts.shape[1]
    q = draft_probs if draft_probs is not None else torch.nn.functional.one_hot(drafts, V).to(probs.dtype)
    p_x = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = q.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    accept = uniforms(seeds, positions, k, stream=1) < (p_x / q_x).double()
    valid = torch.arange(k) < draft_lens.unsqueeze(1)
    accepted = (accept & valid).long().cumprod(1).sum(1)
    u = uniforms(seeds, positions, probs.shape[1], stream=0)
    out = []
    for r, a in enumerate(accepted.tolist()):
        out.append(drafts[r, :a].tolist() + [int(inverse_cdf(probs[r, a : a + 1], u[r, a : a + 1]))])
    return Verdict(accepted, out)


def without_noise(logits, drafts, draft_lens, params, seeds, positions, draft_probs=None) -> Verdict:
    """Wrong: the invariant rule with the noise dropped (every target token is the argmax)."""
    targets = probabilities(logits, params).argmax(-1)
    return sampling_module._verdict(drafts, draft_lens, targets, drafts == targets[:, : drafts.shape[1]])


def one_noise_per_row(logits, drafts, draft_lens, params, seeds, positions, draft_probs=None) -> Verdict:
    """Wrong: the invariant rule with the noise of output position 0 reused at every position."""
    probs = probabilities(logits, params)
    noise = sampling_module.exponentials(seeds, [0] * len(seeds), 1, torch.arange(probs.shape[-1]))
    targets = (probs / noise).argmax(-1)
    return sampling_module._verdict(drafts, draft_lens, targets, drafts == targets[:, : drafts.shape[1]])


# ---------------------------------------------------------------------------------------------- fixtures

@pytest.fixture(scope="module")
def target():
    model = tiny_llama(V, seed=1, hidden=32)
    model.generation_config.eos_token_id = None  # no EOS: every sample has three tokens
    return model


def mtp_head(target, vocab_ids: torch.Tensor | None) -> MTPHead:
    torch.manual_seed(3)
    head = MTPHead(HeadSpec.for_target(target, "tiny", 1, 0 if vocab_ids is None else len(vocab_ids)), target)
    if vocab_ids is not None:
        head.vocab_ids.copy_(vocab_ids)
    return head.to(target.dtype).eval()


@pytest.fixture(scope="module")
def drafts(target):
    """Greedy drafts (the deterministic path) come from a draft sharing the target's first layer; sampled
    drafts from an unrelated model, or from an (untrained) MTP head on the target's own states, over the
    whole vocabulary or over 8 of its 12 tokens (q is 0 outside them). All disagree with the target often."""
    decoding = DecodingModel.prepare(target)
    return {"deterministic-draft": DecodingModel.prepare(tiny_draft(target)),
            "sampled-model": DecodingModel.prepare(tiny_llama(V, seed=2, hidden=32)),
            "mtp": (decoding, mtp_head(target, None)), "mtp-reduced": (decoding, mtp_head(target, torch.arange(2, 10)))}


def drafter_for(drafts, path: str, params: SamplingParams):
    sampling = SamplingParams() if path == "deterministic-draft" else params
    if path.startswith("mtp"):
        return MTPDrafter(*drafts[path], sampling)
    return ModelDrafter(drafts[path], sampling)


@pytest.fixture(scope="module")
def exact(target):
    return {params: exact_distributions(target, params) for params in PARAMS}


def sample_first_tokens(target, drafter, params: SamplingParams, n: int, k: int = 2, seed0: int = 0):
    """n completions of three tokens from n seeds, all in one batch; returns (pair counts, third counts)."""
    settings = GenerationSettings(max_new_tokens=3, sampling=params, batch_size=n, max_k=k)
    generator = SpeculativeGenerator(DecodingModel.prepare(target), StubTokenizer(), drafter, FixedK(k), settings)
    result = generator.generate([Request(str(i), PROMPT, seed0 + i) for i in range(n)])
    pairs, thirds = np.zeros((V, V)), np.zeros(V)
    for completion in result.completions:
        a, b, c = completion.token_ids
        pairs[a, b] += 1
        thirds[c] += 1
    return pairs, thirds, result.stats


def acceptance(stats) -> float:
    return stats.accepted_tokens / max(stats.drafted_tokens, 1)


# --------------------------------------------------------------------------------- probabilities() vs HF

@pytest.mark.parametrize("params", [SamplingParams(1.0), SamplingParams(0.5), SamplingParams(1.7, top_k=1),
                                    SamplingParams(1.0, top_k=5), SamplingParams(0.8, top_k=40),
                                    SamplingParams(1.0, top_p=0.5), SamplingParams(0.6, top_p=0.9),
                                    SamplingParams(1.3, top_k=10, top_p=0.7), SamplingParams(0.9, top_k=3, top_p=0.01),
                                    SamplingParams(2.0, top_k=64, top_p=0.999)])
def test_probabilities_match_transformers_warpers(params):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 17, 64, generator=generator) * 3
    ties = torch.randint(-3, 3, (2, 5, 64), generator=generator).float()  # many equal logits
    for case in (logits, ties):
        ours = probabilities(case, params)
        theirs = hf_probs(case.float(), params)
        assert ours.shape == case.shape
        torch.testing.assert_close(ours, theirs, atol=1e-6, rtol=1e-5)
        assert torch.equal(ours > 0, theirs > 0), "the kept sets differ"


# --------------------------------------------------------------------------- verify_sampled on one position

def test_verify_sampled_first_token_is_exactly_the_target_distribution():
    """Unit level, many rows at once: p and q are fixed distributions with disjoint-ish supports (q puts
    mass where p has none and the reverse), the draft is sampled from q by the test. The first output
    token must be distributed as p for the Leviathan rule, for a deterministic draft under either coupling,
    and for the invariant rule (which ignores q)."""
    n = 20_000
    gen = torch.Generator().manual_seed(1)
    p_logits = torch.randn(V, generator=gen, dtype=torch.float64) * 1.5
    params = SamplingParams(1.0, top_k=7, coupling="rejection")
    p = hf_probs(p_logits, params)
    q = torch.softmax(-p_logits * 1.2, -1)  # anti-correlated with p: disagrees often
    q[int(p.argmax())] = 0
    q /= q.sum()
    logits = p_logits.expand(n, 2, V).contiguous()
    drafts = torch.multinomial(q, n, replacement=True, generator=gen).view(n, 1)
    seeds, positions, lens = list(range(n)), [0] * n, torch.ones(n, dtype=torch.long)
    draft_probs = q.float().expand(n, 1, V)

    def counts(verdict: Verdict) -> np.ndarray:
        return np.bincount([t[0] for t in verdict.tokens], minlength=V)

    leviathan = verify_sampled(logits, drafts, lens, params, seeds, positions, draft_probs)
    assert 0.02 < leviathan.accepted.float().mean() < 0.9
    assert chi_square_pvalue(counts(leviathan), p.numpy()) > P_MIN
    invariant = replace(params, coupling="invariant")
    for coupled in (params, invariant):
        deterministic = verify_sampled(logits, drafts, lens, coupled, seeds, positions)
        assert chi_square_pvalue(counts(deterministic), p.numpy()) > P_MIN
    assert verify_sampled(logits, drafts, lens, invariant, seeds, positions, draft_probs).tokens == \
        verify_sampled(logits, drafts, lens, invariant, seeds, positions).tokens, "the invariant rule must not read q"
    for wrong in (accept_everything, skip_residual, without_noise):
        assert chi_square_pvalue(counts(wrong(logits, drafts, lens, params, seeds, positions, draft_probs)),
                                 p.numpy()) < P_MIN, wrong.__name__
    # each row appends its accepted drafts and exactly one more token
    assert all(len(t) == 1 + a for t, a in zip(leviathan.tokens, leviathan.accepted.tolist()))


def test_uniforms_are_a_pure_function_of_seed_and_position():
    a = uniforms([3, 4, 5], [0, 10, 20], 6, stream=0)
    b = uniforms([5, 3], [22, 1], 3, stream=0)
    assert torch.equal(b[0], a[2, 2:5]) and torch.equal(b[1], a[0, 1:4])
    assert not torch.equal(uniforms([3], [0], 6, stream=1), a[:1])
    many = uniforms(list(range(2000)), [0] * 2000, 8, stream=0).ravel()
    assert ((many >= 0) & (many < 1)).all()
    hist = np.histogram(many.numpy(), bins=10, range=(0, 1))[0]
    assert chi_square_pvalue(hist, np.full(10, 0.1)) > P_MIN


# ---------------------------------------------------------------------------- the generator, end to end

N = 3000


@pytest.mark.parametrize("coupling", COUPLINGS)
@pytest.mark.parametrize("params", PARAMS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("path", ["deterministic-draft", "sampled-model", "mtp", "mtp-reduced"])
def test_generator_samples_the_target_distribution(target, drafts, exact, params, path, coupling):
    drafter = drafter_for(drafts, path, replace(params, coupling=coupling))
    pairs, thirds, stats = sample_first_tokens(target, drafter, replace(params, coupling=coupling), N, k=2, seed0=1000)
    assert drafter.sampling.greedy == (path == "deterministic-draft")
    # the draft disagrees with the target often, but accepts enough for acceptance paths to matter
    assert acceptance(stats) < 0.7
    assert stats.accepted_by_position[0] >= 0.1 * N and stats.accepted_by_position[1] >= 0.02 * N
    joint, third = exact[params]
    assert chi_square_pvalue(pairs, joint) > P_MIN
    assert chi_square_pvalue(thirds, third) > P_MIN


@pytest.mark.parametrize("wrong", [accept_everything, skip_residual, without_noise, one_noise_per_row])
@pytest.mark.parametrize("path", ["deterministic-draft", "sampled-model", "mtp"])
def test_a_wrong_sampler_fails_the_same_check(target, drafts, exact, monkeypatch, wrong, path):
    params = replace(PARAMS[2], coupling="rejection" if wrong in (accept_everything, skip_residual) else "invariant")
    monkeypatch.setattr(generator_module, "verify_sampled", wrong)
    drafter = drafter_for(drafts, path, params)
    pairs, thirds, _ = sample_first_tokens(target, drafter, params, N, k=2, seed0=1000)
    joint, third = exact[PARAMS[2]]
    assert min(chi_square_pvalue(pairs, joint), chi_square_pvalue(thirds, third)) < P_MIN


class Cycle(Drafter):
    def propose(self, rows, k, caps):
        return pack([[(row.tokens[-1] + j + 1) % V for j in range(min(k, cap))] for row, cap in zip(rows, caps)], k)


def test_greedy_k_changes_nothing_under_sampling_with_a_plugged_in_drafter(target, exact):
    """A plugged-in deterministic drafter proposing a fixed, mostly wrong, cycle of tokens."""
    params = PARAMS[0]
    pairs, thirds, stats = sample_first_tokens(target, Cycle(), params, N, k=2, seed0=1000)
    assert stats.drafted_tokens > 0 and stats.accepted_tokens > 0
    joint, third = exact[params]
    assert chi_square_pvalue(pairs, joint) > P_MIN and chi_square_pvalue(thirds, third) > P_MIN
    reference, _, _ = sample_first_tokens(target, Cycle(), params, N, k=0, seed0=1000)
    assert np.array_equal(pairs, reference), "deterministic drafts must not change any completion"


@pytest.mark.parametrize("coupling", COUPLINGS)
@pytest.mark.parametrize("name,min_prob", [("suffix", 0.02), ("suffix+sampled-model", 0.3)])
def test_job_wide_and_composed_drafters_sample_the_target_distribution(target, drafts, exact, name, min_prob, coupling):
    """The suffix drafter first indexes N earlier completions of the prompt (other seeds), then drafts
    their most frequent continuations: often right, often not. Composed with a sampling draft model
    (min_prob 0.3 leaves it about a third of the rows at the second step), the rows the index is unsure
    of take the Leviathan rule and the others a one-hot q, in the same verify pass (rejection coupling),
    or every row races the shared noise (invariant coupling)."""
    params = replace(PARAMS[0], coupling=coupling)
    suffix = SuffixDrafter(max_tokens=10 * N, min_prob=min_prob)
    drafter = suffix if name == "suffix" else ComposedDrafter([suffix, drafter_for(drafts, "sampled-model", params)])
    sample_first_tokens(target, suffix, params, N, k=0, seed0=1_000_000)  # the job so far
    pairs, thirds, stats = sample_first_tokens(target, drafter, params, N, k=2, seed0=1000)
    assert acceptance(stats) < 0.7
    assert stats.accepted_by_position[0] >= 0.1 * N and stats.accepted_by_position[1] >= 0.02 * N
    joint, third = exact[PARAMS[0]]
    assert chi_square_pvalue(pairs, joint) > P_MIN and chi_square_pvalue(thirds, third) > P_MIN
    if name == "suffix":
        reference, _, _ = sample_first_tokens(target, Cycle(), params, N, k=0, seed0=1000)
        assert np.array_equal(pairs, reference), "one-hot drafts must not change any completion"


def test_sampling_oracle_is_sane(exact):
    for joint, third in exact.values():
        assert abs(joint.sum() - 1) < 1e-9 and abs(third.sum() - 1) < 1e-9
    joint, _ = exact[PARAMS[0]]
    assert ((joint > 0).sum(1) <= 6).all()  # top-k 6 leaves at most 6 second tokens per first one
    assert set(itertools.chain(*[np.flatnonzero(row) for row in joint])) <= set(range(V))
