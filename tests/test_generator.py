"""The batched speculative generator against transformers' own `generate` (the oracle nobody here wrote).

Greedy: every drafter (none, n-gram, suffix, a draft model, a plugged-in synthetic one, a composition),
every k in 0..MAX_K,
batch sizes 1 and > 1, prompts of mixed lengths and more prompts than slots, must give exactly the
tokens of `model.generate(do_sample=False)` run per prompt at batch size 1. Then the ways rows end
(EOS, stop strings, max_new_tokens, empty and overlong prompts), reproducibility under sampling, and
the counters.
"""
from __future__ import annotations

import os
import re
import time
from dataclasses import replace

import pytest
import torch

from tests.tiny_models import OracleDrafter, tiny_draft, tiny_llama, tiny_tokenizer
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import NoDrafter
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.model_drafter import ModelDrafter
from workers.engine.ngram_drafter import NgramDrafter
from workers.engine.sampling import SamplingParams
from workers.engine.suffix_drafter import SuffixDrafter

MAX_K = 4
GREEDY = SamplingParams()
MAX_NEW = 14
PROMPTS = [
    "the quick brown fox jumps",
    "rewrite this sentence politely please. rewrite this sentence politely",
    "def add(a, b):",
    "why",
    "extract the names and dates from the text below: 0123 (a, b) the quick",
]


pytestmark = pytest.mark.usefixtures("one_torch_thread")


def hf_greedy(model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    """transformers' own greedy decoding of one prompt at batch size 1: the oracle."""
    out = model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids), dtype=torch.long),
                         do_sample=False, max_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return tiny_llama(len(tok), seed=0)


@pytest.fixture(scope="module")
def draft(target):
    return tiny_draft(target)


@pytest.fixture(scope="module")
def prompt_ids(tok):
    ids = [tok(p)["input_ids"] for p in PROMPTS] + [[tok.bos_token_id]]  # plus a one-token prompt
    assert len({len(i) for i in ids}) == len(ids), "the prompts should have mixed lengths"
    return ids


@pytest.fixture(scope="module")
def references(target, prompt_ids):
    return [hf_greedy(target, ids, MAX_NEW) for ids in prompt_ids]


def make_drafter(name: str, draft, references, prompt_ids, vocab: int, sampling: SamplingParams = GREEDY):
    if name == "none":
        return NoDrafter()
    if name == "ngram":
        return NgramDrafter(3)
    if name == "model":
        return ModelDrafter(DecodingModel.prepare(draft), sampling)
    if name == "suffix":
        return SuffixDrafter(max_tokens=4096)
    if name == "synthetic":
        return OracleDrafter({tuple(p): r for p, r in zip(prompt_ids, references)}, alpha=0.6, vocab_size=vocab, seed=7)
    if "+" in name:
        return ComposedDrafter([make_drafter(part, draft, references, prompt_ids, vocab, sampling)
                                for part in name.split("+")])
    raise ValueError(name)


def run(target, tok, drafter, k: int, requests: list[Request], **settings):
    settings = {"max_new_tokens": MAX_NEW, "max_k": MAX_K, **settings}
    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, drafter, FixedK(k), GenerationSettings(**settings))
    result = generator.generate(requests)
    return result.stats, result.completions


def requests_for(prompt_ids, seed0: int = 0) -> list[Request]:
    return [Request(f"r{i}", list(ids), seed0 + i) for i, ids in enumerate(prompt_ids)]


def check_stats(stats, k: int) -> None:
    assert stats.target_passes > 0
    assert int(stats.k_hist.sum()) == stats.target_passes
    # a pass's k is its longest verified draft: never past FixedK's k, less where budgets end or drafts run out
    assert int(stats.k_hist[k + 1 :].sum()) == 0
    assert (stats.k_hist[1:] > 0).any() == (stats.drafted_tokens > 0)
    assert stats.drafted_tokens >= stats.accepted_tokens >= 0
    assert (stats.accepted_by_position <= stats.attempted_by_position).all()
    assert int(stats.accepted_by_position.sum()) == stats.accepted_tokens
    if k == 0:
        assert stats.drafted_tokens == 0 and stats.draft_passes == 0


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("k", range(MAX_K + 1))
@pytest.mark.parametrize("drafter_name", ["none", "ngram", "suffix", "model", "synthetic", "suffix+model"])
def test_greedy_equals_transformers_generate(tok, target, draft, prompt_ids, references, drafter_name, k, batch_size):
    drafter = make_drafter(drafter_name, draft, references, prompt_ids, len(tok))
    stats, results = run(target, tok, drafter, k, requests_for(prompt_ids), batch_size=batch_size)
    for ids, ref, result in zip(prompt_ids, references, results):
        assert result.token_ids == ref, f"prompt of {len(ids)} tokens"
        assert result.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
        assert result.text == tok.decode(ref, skip_special_tokens=True)
        assert result.prompt_tokens == len(ids)
        assert result.error is None
    check_stats(stats, k)
    assert stats.generated_tokens == sum(len(r) for r in references)
    assert stats.prompt_tokens == sum(len(p) for p in prompt_ids)
    # every step verifies at least one token per live row, so speculation can only save passes
    assert stats.target_passes <= MAX_NEW * len(prompt_ids)
    if k and drafter_name in ("model", "synthetic", "suffix+model"):
        assert stats.accepted_tokens > 0, "speculation never paid; the test would not exercise acceptance"
    if drafter_name == "model" and k:
        assert stats.draft_passes == sum(j * int(n) for j, n in enumerate(stats.k_hist))


@pytest.mark.parametrize("drafter_name", ["ngram", "suffix", "model", "synthetic"])
def test_rows_hitting_eos_early_leave_the_batch(tok, prompt_ids, drafter_name):
    target = tiny_llama(len(tok), seed=0)
    plain = [hf_greedy(target, ids, MAX_NEW) for ids in prompt_ids]
    eos = plain[0][3]  # a token the greedy output produces early: make it an end of sequence
    target.generation_config.eos_token_id = [tok.eos_token_id, eos]
    references = [hf_greedy(target, ids, MAX_NEW) for ids in prompt_ids]
    assert len(references[0]) <= 4 and references[0][-1] == eos
    assert any(len(r) == MAX_NEW and eos not in r for r in references), "want a row that runs to max_new_tokens too"
    drafter = make_drafter(drafter_name, tiny_draft(target), references, prompt_ids, len(tok))
    live_rows = []

    class Counting(FixedK):
        def observe(self, step):
            live_rows.append(len(step.offered))

    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, drafter, Counting(3),
                                     GenerationSettings(max_new_tokens=MAX_NEW, max_k=MAX_K, batch_size=2))
    result = generator.generate(requests_for(prompt_ids))
    stats, results = result.stats, result.completions
    # every row-step yields at least one token, so finished rows cannot have stayed in the batch
    assert max(live_rows) == 2 and sum(live_rows) <= sum(len(r) for r in references)
    for ref, result in zip(references, results):
        assert result.token_ids == ref
        if ref[-1] in (tok.eos_token_id, eos):
            assert result.finish_reason == "stop"
        else:
            assert result.finish_reason == "length" and len(result.token_ids) == MAX_NEW
    assert stats.generated_tokens == sum(len(r) for r in references)
    check_stats(stats, 3)


def pick_stop(text: str) -> str:
    """Two ASCII letters from the middle of a completion: a stop string that surely occurs."""
    match = re.search(r"[a-z]{2}", text[3:])
    assert match, text
    return match.group(0)


@pytest.mark.parametrize("drafter_name,k,batch_size", [("none", 0, 1), ("ngram", 3, 2), ("synthetic", 4, 2),
                                                        ("model", 2, 3), ("suffix", 3, 2), ("suffix+ngram", 4, 3)])
def test_stop_strings(tok, target, draft, prompt_ids, references, drafter_name, k, batch_size):
    stop = pick_stop(tok.decode(references[1], skip_special_tokens=True))
    stops = (stop, "never appears \u2603")
    drafter = make_drafter(drafter_name, draft, references, prompt_ids, len(tok))
    stats, results = run(target, tok, drafter, k, requests_for(prompt_ids), batch_size=batch_size, stop=stops)
    stopped = 0
    for ref, result in zip(references, results):
        full = tok.decode(ref, skip_special_tokens=True)
        cut = full.find(stop)
        if cut < 0:
            assert result.token_ids == ref and result.text == full
            assert result.finish_reason == ("stop" if ref[-1] == tok.eos_token_id else "length")
            continue
        stopped += 1
        # the fewest tokens whose text contains the stop string; the text ends right before it
        m = next(m for m in range(1, len(ref) + 1) if stop in tok.decode(ref[:m], skip_special_tokens=True))
        assert result.finish_reason == "stop"
        assert result.token_ids == ref[:m]
        assert result.text == full[:cut]
        assert stop not in result.text
        assert full.startswith(result.text + stop)
    assert stopped >= 1
    check_stats(stats, k)


@pytest.mark.parametrize("drafter_name", ["ngram", "model"])
def test_empty_and_overlong_prompts(tok, prompt_ids, drafter_name):
    context, max_new = 48, 8
    budget = context - max_new
    target = tiny_llama(len(tok), seed=0, max_positions=context)
    long_ids = [t for p in PROMPTS for t in tok(p)["input_ids"]]
    assert len(long_ids) > budget + 1
    batch = [prompt_ids[0], long_ids[: budget + 1], [], prompt_ids[2], long_ids[:budget], long_ids, prompt_ids[3]]
    requests = [Request(f"r{i}", ids, i) for i, ids in enumerate(batch)]
    kept = [ids if len(ids) <= budget else ids[-budget:] for ids in batch]
    refs = [hf_greedy(target, ids, max_new) if ids else None for ids in kept]

    drafter = make_drafter(drafter_name, tiny_draft(target), None, None, len(tok))
    stats, results = run(target, tok, drafter, 3, requests, batch_size=2, max_new_tokens=max_new, overlong="error")
    for ids, ref, result in zip(batch, refs, results):
        if not ids or len(ids) > budget:
            assert result.finish_reason == "error" and result.error and result.token_ids == []
        else:  # the rest of the batch completes, the prompt of exactly `budget` tokens included
            assert result.finish_reason == "length" and result.token_ids == ref
    assert "context" in results[1].error and str(context) in results[1].error
    check_stats(stats, 3)

    drafter = make_drafter(drafter_name, tiny_draft(target), None, None, len(tok))
    _, results = run(target, tok, drafter, 3, requests, batch_size=2, max_new_tokens=max_new, overlong="truncate")
    for ids, ref, result in zip(batch, refs, results):
        if not ids:
            assert result.finish_reason == "error" and result.error
        else:  # truncation keeps the prompt's end
            assert result.finish_reason == "length" and result.token_ids == ref
            assert result.prompt_tokens == min(len(ids), budget)


SAMPLING = SamplingParams(temperature=0.9, top_k=50, top_p=0.95)


@pytest.mark.parametrize("coupling", ["invariant", "rejection"])
def test_sampling_is_reproducible_and_independent_of_k_batch_and_deterministic_drafter(tok, target, draft, prompt_ids,
                                                                                        coupling):
    requests = requests_for(prompt_ids, seed0=1234)
    sampling = replace(SAMPLING, coupling=coupling)
    outputs, drafted = {}, 0
    for name, k, batch_size in [("ngram", 0, 1), ("ngram", 2, 3), ("ngram", 4, 1), ("ngram", 4, 4), ("ngram", 1, 6),
                                ("none", 3, 2), ("greedy-model", 3, 2), ("suffix", 3, 3), ("suffix+ngram", 4, 2)]:
        drafter = ModelDrafter(DecodingModel.prepare(draft), SamplingParams()) if name == "greedy-model" else make_drafter(
            name, draft, None, None, len(tok))
        stats, results = run(target, tok, drafter, k, requests, batch_size=batch_size, sampling=sampling)
        outputs[(name, k, batch_size)] = [r.token_ids for r in results]
        drafted += stats.drafted_tokens if name == "ngram" else 0
        check_stats(stats, k)
    assert drafted > 0, "the n-gram drafter proposed nothing; k would not matter"
    first = next(iter(outputs.values()))
    for key, tokens in outputs.items():
        assert tokens == first, key
    assert all(len(t) == MAX_NEW or t[-1] == tok.eos_token_id for t in first)
    # the seed matters, and the sample is not the greedy one
    _, other = run(target, tok, NgramDrafter(), 2, requests_for(prompt_ids, seed0=99), batch_size=3, sampling=sampling)
    assert [r.token_ids for r in other] != first


def test_leviathan_path_is_reproducible_across_runs_and_batch_sizes(tok, target, draft, prompt_ids):
    requests = requests_for(prompt_ids, seed0=5)
    rejection = replace(SAMPLING, coupling="rejection")
    outputs = []
    for batch_size in (1, 3, 3):
        stats, results = run(target, tok, ModelDrafter(DecodingModel.prepare(draft), rejection), 3, requests,
                             batch_size=batch_size, sampling=rejection)
        outputs.append([r.token_ids for r in results])
        check_stats(stats, 3)
        assert stats.accepted_tokens > 0
    assert outputs[0] == outputs[1] == outputs[2]


@pytest.mark.parametrize("drafter_name,k", [("none", 0), ("ngram", 3), ("model", 2)])
def test_logprobs_are_the_targets_own_whatever_the_drafter(tok, target, draft, prompt_ids, references, drafter_name, k):
    """Against transformers' raw per-step logits: speculation must not change a single log-probability."""
    top = 3
    drafter = make_drafter(drafter_name, draft, references, prompt_ids, len(tok))
    _, results = run(target, tok, drafter, k, requests_for(prompt_ids), batch_size=3, logprobs=top)
    for ids, ref, result in zip(prompt_ids, references, results):
        out = target.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                              do_sample=False, max_new_tokens=MAX_NEW, output_logits=True, return_dict_in_generate=True,
                              pad_token_id=tok.pad_token_id)
        logp = torch.log_softmax(torch.cat(out.logits).float(), -1)[: len(ref)]
        assert len(result.logprobs) == len(result.top_logprobs) == len(ref)
        torch.testing.assert_close(torch.tensor(result.logprobs), logp[torch.arange(len(ref)), torch.tensor(ref)],
                                   rtol=1e-5, atol=1e-5)
        best = logp.topk(top, -1)
        assert [[t for t, _ in pos] for pos in result.top_logprobs] == best.indices.tolist()
        assert result.top_logprobs[0][0][0] == ref[0]  # greedy: the chosen token is the most likely one


def test_no_logprobs_unless_asked(tok, target, prompt_ids):
    _, results = run(target, tok, NgramDrafter(), 2, requests_for(prompt_ids[:2]))
    assert all(r.logprobs is None and r.top_logprobs is None for r in results)


def test_phase_times_add_up_to_the_wall_time(tok, target, prompt_ids):
    """prefill + draft + verify + controller + other account for generate()'s whole wall time (within 1%)."""
    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, NgramDrafter(3), FixedK(2),
                                     GenerationSettings(max_new_tokens=MAX_NEW, max_k=MAX_K, batch_size=2))
    started = time.perf_counter()
    stats = generator.generate(requests_for(prompt_ids)).stats
    wall = time.perf_counter() - started
    parts = [stats.prefill_s, stats.draft_s, stats.verify_s, stats.controller_s, stats.other_s]
    assert min(parts) > 0
    assert sum(parts) == pytest.approx(wall, rel=0.01)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.skipif(os.environ.get("SPECBATCH_SLOW_TESTS") != "1",
                    reason="torch.compile takes a minute or more on a small CPU; set SPECBATCH_SLOW_TESTS=1")
def test_compiled_decoder_gives_the_eager_tokens(tok, prompt_ids):
    """model.compile: the compiled layers (fp32: oneDNN matmuls as an opaque op) decode the eager path's tokens."""
    model = tiny_llama(len(tok), layers=1, seed=1, dtype=torch.float32)
    outputs = []
    for compile in (False, True):
        generator = SpeculativeGenerator(DecodingModel.prepare(model, compile=compile), tok, NgramDrafter(3), FixedK(2),
                                         GenerationSettings(max_new_tokens=MAX_NEW, max_k=MAX_K, batch_size=3))
        outputs.append([c.token_ids for c in generator.generate(requests_for(prompt_ids)).completions])
    assert outputs[0] == outputs[1]
