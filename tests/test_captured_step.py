"""The static-shape step that CUDA graphs capture, run eagerly on the CPU: same buckets, padding and mask.

On a GPU the step is replayed from a graph (make gpu-check checks that path against transformers); here
its math is checked: a captured-step generator gives transformers' greedy tokens at every batch size and
k, its hidden states match the eager step's, and padding never touches a live row's cache.
"""
from __future__ import annotations

import pytest
import torch

from tests.test_generator import MAX_K, MAX_NEW, hf_greedy, make_drafter, requests_for
from tests.test_generator import target, tok  # noqa: F401  (module fixtures shared with the generator's tests)
from tests.tiny_models import tiny_draft
from workers.engine.cached_lm import CachedLM
from workers.engine.captured_step import WIDTHS, buckets
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.generator import GenerationSettings, SpeculativeGenerator

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def prompt_ids(tok):
    prompts = ["the quick brown fox jumps", "rewrite this sentence politely please. rewrite this", "def add(a, b):", "why"]
    return [tok(p)["input_ids"] for p in prompts] + [[tok.bos_token_id]]


def test_buckets_cover_every_row_count_within_twice():
    assert buckets(1) == [1] and buckets(5) == [1, 2, 4, 5] and buckets(8) == [1, 2, 4, 8]
    for limit in (1, 3, 7, 16, 100):
        sizes = buckets(limit)
        assert sizes[-1] == limit
        for n in range(1, limit + 1):
            assert n <= next(s for s in sizes if s >= n) < 2 * n


def test_default_step_is_eager_on_cpu(target):
    assert DecodingModel.prepare(target).step == "eager"
    assert DecodingModel.prepare(target, step="captured").step == "captured"


@pytest.mark.parametrize("batch_size", [1, 3, 5])
@pytest.mark.parametrize("drafter_name,k", [("none", 0), ("ngram", 3), ("model", 4), ("suffix", 2)])
def test_captured_greedy_equals_transformers_generate(tok, target, prompt_ids, drafter_name, k, batch_size):
    references = [hf_greedy(target, ids, MAX_NEW) for ids in prompt_ids]
    drafter = make_drafter(drafter_name, tiny_draft(target), references, prompt_ids, len(tok))
    model = DecodingModel.prepare(target, step="captured")
    generator = SpeculativeGenerator(model, tok, drafter, FixedK(k),
                                     GenerationSettings(max_new_tokens=MAX_NEW, max_k=MAX_K, batch_size=batch_size))
    results = generator.generate(requests_for(prompt_ids)).completions
    assert [r.token_ids for r in results] == references


def test_static_step_matches_eager_and_keeps_padding_out_of_live_rows(tok, target, prompt_ids):
    eager, captured = DecodingModel.prepare(target), DecodingModel.prepare(target, step="captured")
    lms = [CachedLM(m, 5, 64) for m in (eager, captured)]
    for lm in lms:
        lm.prefill(prompt_ids[:4], 0)
    assert lms[1].steps is not None
    for width in (1, 3, 8):   # 3 pads to the width-4 bucket; rows pad 3 -> 4
        tokens = torch.randint(3, len(tok), (3, width))
        want, got = (lm.forward(tokens) for lm in lms)
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-9)
    assert set(lms[1].steps.buckets) == {(4, 1), (4, 4), (4, 8)} and 3 not in WIDTHS
    # slot 3 was prefilled but not fed: padding rows wrote only to the scratch column past its capacity
    for layer in range(len(eager.fused.layers)):
        live = int(lms[0].lengths[3])
        torch.testing.assert_close(lms[1].cache.keys[layer][3, :, :live], lms[0].cache.keys[layer][3, :, :live])
