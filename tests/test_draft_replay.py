"""The plan's replay of a model-free drafter over known completions counts exactly what a fixed-k run counts."""
from __future__ import annotations

import random

import numpy as np
import pytest

from jobs.draft_replay import replay, replay_fixed_k, replayable
from tests.tiny_models import StubTokenizer, tiny_llama
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.controller import AdaptiveK, FixedK
from workers.engine.costs import CostModel
from workers.engine.decoding_model import DecodingModel
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.ngram_drafter import NgramDrafter
from workers.engine.sampling import SamplingParams
from workers.engine.suffix_drafter import SuffixDrafter

DRAFTERS = {"ngram": lambda: NgramDrafter(3), "suffix": lambda: SuffixDrafter(10_000),
            "suffix+ngram": lambda: ComposedDrafter([SuffixDrafter(10_000), NgramDrafter(3)])}


@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.9)], ids=["greedy", "sampled"])
@pytest.mark.parametrize("k", [1, 4])
@pytest.mark.parametrize("name", sorted(DRAFTERS))
def test_replay_counts_what_a_fixed_k_run_counts(name, k, sampling):
    target = DecodingModel.prepare(tiny_llama(24, seed=3, hidden=32))
    rng = random.Random(0)
    requests = [Request(str(i), [rng.randrange(24) for _ in range(rng.randrange(4, 12))], seed=i) for i in range(6)]
    settings = GenerationSettings(max_new_tokens=40, batch_size=1, max_k=k, sampling=sampling)
    run = SpeculativeGenerator(target, StubTokenizer(), DRAFTERS[name](), FixedK(k), settings).generate(requests)
    completions = [c.token_ids for c in run.completions]
    replayed = replay_fixed_k(DRAFTERS[name](), [r.prompt_ids for r in requests], completions, k, 40)
    assert run.stats.accepted_tokens > 0, "the tiny model repeats itself: drafts must be accepted"
    for counter in ("attempted_by_position", "accepted_by_position"):
        assert np.array_equal(getattr(replayed, counter), getattr(run.stats, counter)), counter
    assert (replayed.generated_tokens, replayed.row_passes, replayed.drafted_tokens) == \
        (run.stats.generated_tokens, run.stats.row_passes, run.stats.drafted_tokens)


def test_only_model_free_drafters_are_replayed():
    assert replayable(NgramDrafter(3)) and replayable(DRAFTERS["suffix+ngram"]())
    model_drafter = type("Drafted", (NgramDrafter,), {"passes_per_token": 1})(3)
    assert not replayable(model_drafter) and not replayable(ComposedDrafter([SuffixDrafter(10), model_drafter]))


def test_a_replayed_controller_generates_every_token_and_pays_each_pass_at_its_width():
    """Under adaptive k the replay still moves through every completion token exactly; each step's modelled
    seconds are its width's price, and the controller sees those prices (its cost table learns them)."""
    target = DecodingModel.prepare(tiny_llama(24, seed=3, hidden=32))
    rng = random.Random(1)
    requests = [Request(str(i), [rng.randrange(24) for _ in range(rng.randrange(4, 12))], seed=i) for i in range(6)]
    settings = GenerationSettings(max_new_tokens=40, batch_size=1, max_k=0)
    completions = [c.token_ids for c in SpeculativeGenerator(target, StubTokenizer(), NgramDrafter(3), FixedK(0),
                                                             settings).generate(requests).completions]
    prices = {w: 0.01 * (1 + 0.1 * (w - 1)) for w in range(1, 6)}
    widths: list[int] = []
    controller = AdaptiveK(4, 1, costs=CostModel())
    stats = replay(NgramDrafter(3), controller, [r.prompt_ids for r in requests], completions, 40,
                   lambda w: widths.append(w) or prices[w])
    assert stats.generated_tokens == sum(map(len, completions)) and stats.target_passes == len(widths)
    assert stats.accepted_tokens > 0 and max(widths) > 1
    assert stats.verify_s == pytest.approx(sum(prices[w] for w in widths))
    assert controller.costs.verify(1, 3) == pytest.approx(prices[3]) and stats.controller_s > 0
    fixed = replay(NgramDrafter(3), FixedK(4), [r.prompt_ids for r in requests], completions, 40)
    assert fixed.generated_tokens == stats.generated_tokens and fixed.verify_s == 0.0
