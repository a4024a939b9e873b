"""Drafter-invariant sampling (Daliri et al. 2024): the target's token at each output position is the Gumbel-max
race of its distribution against noise fixed by (row seed, position, token id); a model draft races the same
noise, so a sampled completion is a function of (target, seed) alone, whatever drafted it.

Checked here: the race samples exactly (chi-square against exact probabilities; it fails without the noise),
draft and target races agree as often as the coupling's closed form says (so they share the noise, by
full-vocabulary id for a reduced draft vocabulary), the noise is a pure function of (seed, position, token),
and whole generations are token for token the same across drafters, k, controllers and batch sizes.
"""
from __future__ import annotations

import math
from dataclasses import replace

import numpy as np
import pytest
import torch

import workers.engine.sampling as sampling_module
from tests.test_sampling import P_MIN, chi_square_pvalue, mtp_head
from tests.tiny_models import StubTokenizer, tiny_draft, tiny_llama
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import NoDrafter
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.model_drafter import ModelDrafter
from workers.engine.mtp_drafter import MTPDrafter
from workers.engine.ngram_drafter import NgramDrafter
from workers.engine.sampling import NOISE_STREAM, SamplingParams, draft_sample, exponentials, probabilities, race
from workers.engine.suffix_drafter import SuffixDrafter
from workers.registry import make_controller

pytestmark = pytest.mark.usefixtures("one_torch_thread")

V = 16
N = 20_000
_MASK64 = (1 << 64) - 1


def counts(tokens: torch.Tensor) -> np.ndarray:
    return np.bincount(tokens.ravel().numpy(), minlength=V)


def fixed_distribution(seed: int, top_k: int = 0) -> torch.Tensor:
    logits = torch.randn(V, generator=torch.Generator().manual_seed(seed)) * 1.5
    return probabilities(logits, SamplingParams(1.0, top_k=top_k))


# ------------------------------------------------------------------------------------ the race and the noise

def test_the_race_samples_each_distribution_exactly(monkeypatch):
    p = fixed_distribution(4, top_k=9)  # zeros outside the top 9: never drawn
    many_seeds = race(p.expand(N, 1, V), list(range(N)), [5] * N)
    assert chi_square_pvalue(counts(many_seeds), p.numpy()) > P_MIN
    many_positions = race(p.expand(1, N, V), [7], [0])
    assert chi_square_pvalue(counts(many_positions), p.numpy()) > P_MIN
    ids = torch.arange(3, 13)  # a reduced vocabulary: column i is token ids[i]
    sub = p[ids] / p[ids].sum()
    expected = torch.zeros(V).index_put_((ids,), sub)
    assert chi_square_pvalue(counts(ids[race(sub.expand(N, 1, len(ids)), list(range(N)), [5] * N, ids)]),
                             expected.numpy()) > P_MIN
    monkeypatch.setattr(sampling_module, "_negative_exponentials",
                        lambda keys, ids: torch.full((len(keys), len(ids)), -1.0))  # no noise
    assert chi_square_pvalue(counts(race(p.expand(N, 1, V), list(range(N)), [5] * N)), p.numpy()) < P_MIN


def gumbel_agreement(p: torch.Tensor, q: torch.Tensor) -> float:
    """P(argmax p/E == argmax q/E) for shared Exp(1) noise E: both pick v iff E_u > E_v max(p_u/p_v, q_u/q_v)
    for every u, which has probability 1 / sum_u max(p_u/p_v, q_u/q_v)."""
    both = (p > 0) & (q > 0)
    p, q = p.double(), q.double()
    return sum(1 / float(torch.maximum(p / p[v], q / q[v]).sum()) for v in torch.nonzero(both).ravel().tolist())


def test_draft_and_target_share_the_noise_by_token_id():
    """A draft over 10 of the 16 tokens, raced by draft_sample with its full-vocabulary ids, agrees with the
    target's race exactly as often as the closed form says, between Daliri et al.'s bound (1 - TV)/(1 + TV)
    and the best any coupling can do, 1 - TV. Draft noise from another position agrees far less often."""
    p = fixed_distribution(5)
    ids = torch.arange(2, 12)
    q = fixed_distribution(6)[ids].softmax(-1)
    q_full = torch.zeros(V).index_put_((ids,), q)
    tv = 0.5 * float((p - q_full).abs().sum())
    expected = gumbel_agreement(p, q_full)
    assert (1 - tv) / (1 + tv) <= expected <= 1 - tv
    seeds, positions = list(range(N)), [9] * N
    target = race(p.expand(N, 1, V), seeds, positions).squeeze(1)
    params = SamplingParams(1.0)
    draft = ids[draft_sample(q.expand(N, len(ids)), params, seeds, positions, ids)]
    sigma = math.sqrt(expected * (1 - expected) / N)
    assert abs(float((draft == target).double().mean()) - expected) < 5 * sigma
    elsewhere = ids[draft_sample(q.expand(N, len(ids)), params, seeds, [10] * N, ids)]
    assert float((elsewhere == target).double().mean()) < expected - 20 * sigma
    rejection = ids[draft_sample(q.expand(N, len(ids)), replace(params, coupling="rejection"), seeds, positions, ids)]
    assert float((rejection == target).double().mean()) < expected - 20 * sigma  # its own stream


def reference_noise(seed: int, position: int, token: int) -> float:
    """One noise entry in plain Python integers: MurmurHash3's fmix64 of the position's key xor the token's salt."""
    x = sampling_module._keys([seed], [position], 1, NOISE_STREAM)[0][0] ^ (token * 0x9E3779B97F4A7C15 & _MASK64)
    for multiplier in (0xFF51AFD7ED558CCD, 0xC4CEB9FE1A85EC53):
        x = ((x ^ (x >> 33)) * multiplier) & _MASK64
    x ^= x >> 33
    return -math.log1p(-((x & (1 << 53) - 1) + 0.5) * 2.0 ** -53)


def test_the_noise_is_a_pure_function_of_seed_position_and_token():
    ids = torch.arange(64)
    seeds = [3, 2**63 - 1, 0]
    a = exponentials(seeds, [0, 10, 20], 6, ids)
    picked = torch.tensor([5, 63, 0])
    b = exponentials([0, 3], [22, 1], 3, picked)  # other rows, widths and token subsets: the same entries
    assert torch.equal(b[0], a[2, 2:5][:, picked]) and torch.equal(b[1], a[0, 1:4][:, picked])
    for (r, j, token) in [(0, 0, 0), (1, 5, 63), (2, 3, 17), (1, 0, 1)]:
        assert math.isclose(float(a[r, j, token]), reference_noise(seeds[r], [0, 10, 20][r] + j, token), rel_tol=1e-6)
    many = exponentials(list(range(500)), [0] * 500, 4, ids)
    assert bool((many > 0).all()) and len(torch.unique(many)) > 0.99 * many.numel()
    hist = np.histogram((1 - torch.exp(-many.double())).numpy(), bins=20, range=(0, 1))[0]
    assert chi_square_pvalue(hist, np.full(20, 0.05)) > P_MIN  # Exp(1): 1 - exp(-E) is uniform


def test_the_race_in_cache_sized_blocks_is_the_plain_formula():
    """A vocabulary of 2^16 + 3 makes the CPU race go 3 positions at a time: the winners are argmax p / E still."""
    probs = torch.rand(2, 4, (1 << 16) + 3) ** 8
    seeds, starts = [11, 12], [0, 40]
    plain = (probs / exponentials(seeds, starts, 4, torch.arange(probs.shape[-1]))).argmax(-1)
    assert torch.equal(race(probs, seeds, starts), plain)


# ---------------------------------------------------------------------------- whole generations, any drafter

PROMPTS = [[1, 5, 7, 3, 1, 5, 7], [4, 4, 9, 4, 4], [2, 11, 6, 13, 2, 11, 6], [8, 3]]
REQUESTS = [Request(f"r{i}-{s}", prompt, 1000 * i + s) for i, prompt in enumerate(PROMPTS) for s in range(2)]
MAX_NEW = 12
SETTINGS = [SamplingParams(0.9), SamplingParams(1.0, top_k=10, top_p=0.9)]
DRAFTERS = ["ngram", "suffix", "model", "mtp", "mtp-reduced", "suffix+model"]


@pytest.fixture(scope="module")
def target():
    model = tiny_llama(V, seed=1, hidden=32)
    model.generation_config.eos_token_id = None  # every row runs MAX_NEW tokens
    return model


@pytest.fixture(scope="module")
def models(target):
    decoding = DecodingModel.prepare(target)
    return {"target": decoding, "draft": DecodingModel.prepare(tiny_draft(target)),
            "mtp": (decoding, mtp_head(target, None)), "mtp-reduced": (decoding, mtp_head(target, torch.arange(2, 14)))}


def build(name: str, models: dict, params: SamplingParams):
    if "+" in name:
        return ComposedDrafter([build(part, models, params) for part in name.split("+")])
    if name.startswith("mtp"):
        return MTPDrafter(*models[name], params)
    return {"none": NoDrafter, "ngram": lambda: NgramDrafter(2), "suffix": lambda: SuffixDrafter(4096, min_prob=0.3),
            "model": lambda: ModelDrafter(models["draft"], params)}[name]()


def generate(models: dict, name: str, params: SamplingParams, k: int | str, batch_size: int):
    settings = GenerationSettings(max_new_tokens=MAX_NEW, sampling=params, batch_size=batch_size, max_k=4)
    generator = SpeculativeGenerator(models["target"], StubTokenizer(), build(name, models, params),
                                     make_controller(k, 4, batch_size), settings)
    result = generator.generate(REQUESTS)
    return [c.token_ids for c in result.completions], result.stats


@pytest.mark.parametrize("params", SETTINGS, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}")
@pytest.mark.parametrize("name", DRAFTERS)
def test_a_sampled_completion_is_the_same_whatever_drafted_it(models, params, name):
    reference, _ = generate(models, "none", params, 0, 1)
    assert len({tuple(t) for t in reference}) == len(REQUESTS), "seeds must matter"
    drafted = accepted = 0
    for k in (2, 4, "adaptive"):
        for batch_size in (1, 3):
            tokens, stats = generate(models, name, params, k, batch_size)
            assert tokens == reference, (k, batch_size)
            drafted, accepted = drafted + stats.drafted_tokens, accepted + stats.accepted_tokens
    assert accepted > 0 and drafted > accepted, "drafts must be both accepted and rejected for this to mean anything"


def test_rejection_coupling_lets_a_draft_model_shape_the_sample(models):
    """Why the invariant coupling exists: under Leviathan's rule the same seeds give other completions with a
    sampling draft model (still exact in distribution), and the same ones with deterministic drafts."""
    params = replace(SETTINGS[0], coupling="rejection")
    reference, _ = generate(models, "none", params, 0, 1)
    assert generate(models, "ngram", params, 2, 3)[0] == reference
    for name in ("model", "mtp"):
        assert generate(models, name, params, 2, 3)[0] != reference, name


def test_a_draft_that_is_the_target_is_always_accepted(models):
    """Draft and target race the same noise at the same output positions: with q = p every draft wins."""
    models = {**models, "draft": models["target"]}
    _, stats = generate(models, "model", SETTINGS[1], 4, 3)
    assert stats.drafted_tokens > 0 and stats.accepted_tokens == stats.drafted_tokens
