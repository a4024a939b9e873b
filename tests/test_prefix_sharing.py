"""Prefill once per prefix: the plan (who copies what, in which round) and the generator with it on.

Sharing must not change a token: with samples of one prompt and a template head before every row, the
generator gives transformers' greedy output, and under sampling the same seeds give the same tokens as
with sharing off (a drafter that reads every prompt state turns it off), while computing far fewer
prompt tokens.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_generator import hf_greedy
from tests.tiny_models import tiny_llama, tiny_tokenizer
from workers.engine.cached_lm import CachedLM
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import NoDrafter
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.ngram_drafter import NgramDrafter
from workers.engine.prefix_sharing import MIN_SHARED, common_prefix, plan_prefill
from workers.engine.sampling import SamplingParams

pytestmark = pytest.mark.usefixtures("one_torch_thread")

HEAD = list(range(10, 40))   # a template's fixed instruction: 30 tokens


def templated(prompts: int, samples: int) -> list[list[int]]:
    """`samples` copies of each of `prompts` prompts, all behind HEAD, interleaved as a shard lists them."""
    bodies = [[50 + p, 60 + p] + list(range(70 + p, 75 + 2 * p)) for p in range(prompts)]
    return [HEAD + body for body in bodies for _ in range(samples)]


def test_common_prefix():
    assert common_prefix((1, 2, 3), (1, 2, 4)) == 2
    assert common_prefix((1, 2), (1, 2, 3)) == 2
    assert common_prefix((), (1,)) == 0
    assert common_prefix(tuple(range(1000)), tuple(range(999)) + (5,)) == 999


def test_plan_computes_the_head_once_and_each_prompt_once():
    prompts = templated(prompts=4, samples=3)
    plan = plan_prefill([tuple(p[:-1]) for p in prompts], {}, start=0)
    assert sorted(plan.order) == list(range(12))
    assert plan.rounds == [1, 3, 8]            # one head, the other distinct prompts, then the repeats
    assert plan.sources[0] is None
    assert all(s.slot == 0 and s.length == len(HEAD) for s in plan.sources[1:4])   # the head, computed in round 0
    for slot, source in enumerate(plan.sources[4:], 4):   # repeats copy their twin whole
        row = prompts[plan.order[slot]]
        assert source.length == len(row) - 1 and source.slot < 4
        assert prompts[plan.order[source.slot]] == row


def test_plan_copies_from_live_rows_and_ignores_short_overlaps():
    live = {0: tuple(HEAD + [1, 2, 3]), 1: tuple(range(200, 220))}
    new = [HEAD + [7, 8, 9], [200, 201, 202, 5, 6], list(range(300, 330))]
    plan = plan_prefill([tuple(p[:-1]) for p in new], live, start=2)
    by_row = dict(zip(plan.order, plan.sources))
    assert by_row[0].slot == 0 and by_row[0].length == len(HEAD)
    assert by_row[1] is None, f"3 shared tokens < MIN_SHARED={MIN_SHARED}: recompute"
    assert by_row[2] is None


def test_prefill_with_sharing_caches_what_prefill_without_it_caches():
    tok = tiny_tokenizer()
    model = DecodingModel.prepare(tiny_llama(len(tok), seed=0))
    prompts = templated(prompts=3, samples=2) + [list(range(100, 140))]
    plain, shared = CachedLM(model, len(prompts), 80), CachedLM(model, len(prompts), 80)
    plain.prefill(prompts, 0)
    plan = shared.plan(prompts, 0)
    ordered = [prompts[i] for i in plan.order]
    assert shared.prefill(ordered, 0, plan) is None
    assert shared.computed_tokens < plain.computed_tokens / 2
    for slot, i in enumerate(plan.order):
        n = len(prompts[i]) - 1
        assert int(shared.lengths[slot]) == n
        for layer in range(len(plain.cache.keys)):
            torch.testing.assert_close(shared.cache.keys[layer][slot, :, :n], plain.cache.keys[layer][i, :, :n])
            torch.testing.assert_close(shared.cache.values[layer][slot, :, :n], plain.cache.values[layer][i, :, :n])


class _ReadsPromptStates(NoDrafter):
    reads_prompt_states = True   # what the MTP drafter says: sharing off


def _generate(target, tok, prompts, drafter, sampling, batch_size, k=0):
    generator = SpeculativeGenerator(target, tok, drafter, FixedK(k),
                                     GenerationSettings(max_new_tokens=10, max_k=4, batch_size=batch_size,
                                                        sampling=sampling))
    return generator.generate([Request(str(i), p, seed=i) for i, p in enumerate(prompts)])


@pytest.mark.parametrize("batch_size", [3, 16])
def test_generation_with_shared_prefixes_is_unchanged(batch_size):
    tok = tiny_tokenizer()
    hf = tiny_llama(len(tok), seed=1)
    target = DecodingModel.prepare(hf)
    prompts = templated(prompts=4, samples=4)
    greedy = _generate(target, tok, prompts, NgramDrafter(3), SamplingParams(), batch_size, k=3)
    assert [c.token_ids for c in greedy.completions] == [hf_greedy(hf, p, 10) for p in prompts]
    assert greedy.stats.prefilled_tokens < greedy.stats.prompt_tokens / 2
    sampling = SamplingParams(temperature=0.9)
    shared = _generate(target, tok, prompts, NoDrafter(), sampling, batch_size)
    unshared = _generate(target, tok, prompts, _ReadsPromptStates(), sampling, batch_size)
    assert unshared.stats.prefilled_tokens == unshared.stats.prompt_tokens - len(prompts)
    assert [c.token_ids for c in shared.completions] == [c.token_ids for c in unshared.completions]
    samples = [tuple(c.token_ids) for c in shared.completions[:4]]
    assert len(set(samples)) > 1, "the samples of one prompt should differ under sampling"
