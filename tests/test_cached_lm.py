"""The slot-cache forward (fused or through transformers' modules) equals a plain full forward."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tests.tiny_models import tiny_llama
from workers.engine.cached_lm import CachedLM, length_groups
from workers.engine.decoding_model import DecodingModel
from workers.engine.fused_decoder import FusedDecoder
from workers.engine.linear import Linear, linear

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def cached_lm(model, fused: bool, monkeypatch, max_rows: int, capacity: int) -> CachedLM:
    """A CachedLM over the fused decoder, or (fused False) over transformers' own decoder modules."""
    if not fused:
        monkeypatch.setattr(FusedDecoder, "supports", staticmethod(lambda m: False))
    lm = CachedLM(DecodingModel.prepare(model), max_rows=max_rows, capacity=capacity)
    assert (lm.model.fused is not None) == fused
    return lm


@pytest.mark.parametrize("fused", [True, False])
def test_rows_of_different_lengths_match_full_forward(fused, monkeypatch):
    model = tiny_llama(64, layers=2, seed=3)
    lm = cached_lm(model, fused, monkeypatch, max_rows=3, capacity=64)
    prompts = [[5, 6, 7, 8, 9, 10], [11, 12], [13, 14, 15, 16]]
    steps = [[20, 21, 22], [23, 24, 25], [26, 27, 28]]
    lm.prefill(prompts, 0)
    logits = lm.logits(torch.tensor([[p[-1]] + s for p, s in zip(prompts, steps)]))
    lm.advance(torch.tensor([2, 1, 4]))  # keep different numbers of the fed tokens per row, as after a verify
    after = lm.logits(torch.tensor([[40], [41], [42]]))
    for row, (prompt, step) in enumerate(zip(prompts, steps)):
        full = model(torch.tensor([prompt + step])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(logits[row], full.float(), rtol=1e-6, atol=1e-6)
        kept = (prompt + step)[: len(prompt) + [2, 1, 4][row] - 1] + [[40], [41], [42]][row]
        torch.testing.assert_close(after[row, 0], model(torch.tensor([kept])).logits[0, -1].float(), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fused", [True, False])
def test_rows_of_equal_length_write_one_slice_and_skip_the_mask(fused, monkeypatch):
    """Equal lengths take the slice write; a width-1 step over them runs without a mask."""
    model = tiny_llama(64, layers=2, seed=7)
    lm = cached_lm(model, fused, monkeypatch, max_rows=2, capacity=32)
    prompts = [[5, 6, 7, 8], [11, 12, 13, 14]]
    lm.prefill(prompts, 0)
    wide = lm.logits(torch.tensor([[8, 20, 21], [14, 22, 23]]))
    lm.advance(torch.tensor([3, 3]))
    narrow = lm.logits(torch.tensor([[30], [31]]))
    for row, seq in enumerate([[5, 6, 7, 8, 20, 21, 30], [11, 12, 13, 14, 22, 23, 31]]):
        full = model(torch.tensor([seq])).logits[0].float()
        torch.testing.assert_close(wide[row], full[3:6], rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(narrow[row, 0], full[6], rtol=1e-6, atol=1e-6)


def test_a_prefill_from_an_empty_cache_runs_causal_attention_and_matches_the_full_forward(monkeypatch):
    """Rows fed from an empty cache take SDPA's causal path (no mask to read, the blocks above the diagonal
    skipped), padding included, and get the full forward's states; a step after a cached prefix keeps the mask."""
    import workers.engine.fused_decoder as fused_decoder

    model = tiny_llama(64, layers=2, seed=5)
    prompts = [[5, 6, 7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18, 19]]
    calls, sdpa = [], F.scaled_dot_product_attention
    monkeypatch.setattr(fused_decoder.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k["is_causal"]) or sdpa(*a, **k))
    lm = CachedLM(DecodingModel.prepare(model), max_rows=2, capacity=32)
    hidden = lm.prefill(prompts, 0)
    assert calls and all(calls)
    for row, prompt in enumerate(prompts):
        full = model.get_decoder()(torch.tensor([prompt[:-1]])).last_hidden_state[0]
        torch.testing.assert_close(hidden[row, : len(prompt) - 1], full, rtol=1e-6, atol=1e-6)
    calls.clear()
    lm.logits(torch.tensor([[12, 30], [19, 31]]))
    assert calls and not any(calls)


def test_slot_moves_keep_a_row_intact():
    model = tiny_llama(64, layers=2, seed=4)
    lm = CachedLM(DecodingModel.prepare(model), max_rows=2, capacity=32)
    lm.prefill([[1, 2, 3], [4, 5, 6, 7, 8]], 0)
    lm.move(1, 0)
    logits = lm.logits(torch.tensor([[9]]))
    torch.testing.assert_close(logits[0, 0], model(torch.tensor([[4, 5, 6, 7, 9]])).logits[0, -1].float())


def test_preparing_leaves_the_source_model_untouched():
    """The bench runs transformers' own generate on the model it prepared: its weights must not change."""
    model = tiny_llama(64, layers=2, seed=5)
    before = {name: (t.data_ptr(), t.stride(), t.clone()) for name, t in model.state_dict().items()}
    DecodingModel.prepare(model)
    for name, t in model.state_dict().items():
        ptr, stride, values = before[name]
        assert (t.data_ptr(), t.stride()) == (ptr, stride), name
        assert torch.equal(t, values), name
    assert not any(name.startswith("_specbatch") for name in vars(model))


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.bfloat16, 3e-2)])
@pytest.mark.parametrize("rows", [1, 5, 24])
def test_linear_layouts_agree_with_f_linear(rows, dtype, tol):
    """On CPU oneDNN's packed layout serves many fp32 rows and every bf16 one where oneDNN has bf16 kernels (else
    bf16 stays plain); the tiled C kernel (or MKL's plain GEMV) a few fp32 rows."""
    torch.manual_seed(0)
    weight, bias, residual = (torch.randn(48, 32).to(dtype), torch.randn(48).to(dtype), torch.randn(rows, 48).to(dtype))
    x = torch.randn(rows, 32).to(dtype)
    weights = Linear.of(weight, bias)
    if dtype == torch.bfloat16 and not torch.ops.mkldnn._is_mkldnn_bf16_supported():
        assert weights.packed is None and weights.plain is not None
    else:
        assert weights.packed is not None and (weights.few_rows is None) == (dtype == torch.bfloat16)
    expected = F.linear(x.float(), weight.float(), bias.float())
    torch.testing.assert_close(linear(x, weights).float(), expected, rtol=tol, atol=tol)
    torch.testing.assert_close(linear(x, weights, residual).float(), residual.float() + expected, rtol=tol, atol=tol)


def test_fp32_forward_matches_full_forward():
    """The fp32 path (packed weights, fused epilogues) within fp32 rounding of transformers' forward."""
    model = tiny_llama(64, layers=2, seed=6, dtype=torch.float32)
    lm = CachedLM(DecodingModel.prepare(model), max_rows=2, capacity=32)
    prompts, steps = [[5, 6, 7, 8, 9], [11, 12]], [[20, 21, 22], [23, 24, 25]]
    lm.prefill(prompts, 0)
    logits = lm.logits(torch.tensor([[p[-1]] + s for p, s in zip(prompts, steps)]))
    for row, (prompt, step) in enumerate(zip(prompts, steps)):
        full = model(torch.tensor([prompt + step])).logits[0, len(prompt) - 1 :]
        torch.testing.assert_close(logits[row], full, rtol=1e-4, atol=1e-4)


def test_length_groups_bound_the_padding():
    assert length_groups([4, 4, 5, 5], 0.25) == [(0, 4)]
    assert length_groups([2, 3, 10, 11, 40], 0.25) == [(0, 2), (2, 4), (4, 5)]
    assert length_groups([0, 0, 7], 0.25) == [(0, 2), (2, 3)]
    for lengths in ([1, 2, 3, 5, 8, 13, 21], [9] * 6, [1, 50, 51, 52]):
        groups = length_groups(lengths, 0.25)
        assert [i for a, b in groups for i in range(a, b)] == list(range(len(lengths)))
        assert all(max(lengths[a:b]) * (b - a) <= 1.25 * max(sum(lengths[a:b]), 1) or b - a == 1 for a, b in groups)


def test_grouped_chunked_prefill_equals_one_padded_pass():
    """Prefill in length groups and chunks leaves the same cache and hidden states as one padded pass."""
    model = tiny_llama(64, layers=2, seed=8, dtype=torch.float32)
    prompts = [[3, 4, 5], [6, 7, 8, 9], list(range(10, 22)), list(range(20, 33)), list(range(30, 60))]
    results = []
    for chunk, waste in ((512, float("inf")), (5, 0.25)):
        lm = CachedLM(DecodingModel.prepare(model), max_rows=6, capacity=64)
        lm.prefill([[1, 2]], 0)  # a live row before them: the new rows go to slots 1..
        hidden = lm.prefill(prompts, 1, chunk=chunk, waste=waste)
        logits = lm.logits(torch.tensor([[p[-1]] for p in prompts]), 1)
        results.append((hidden, logits))
    (one_hidden, one_logits), (grouped_hidden, grouped_logits) = results
    for row, prompt in enumerate(prompts):
        cached = len(prompt) - 1
        torch.testing.assert_close(grouped_hidden[row, :cached], one_hidden[row, :cached], rtol=1e-5, atol=1e-5)
        full = model(torch.tensor([prompt])).logits[0, -1]
        torch.testing.assert_close(grouped_logits[row, 0], full, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(grouped_logits[row, 0], one_logits[row, 0], rtol=1e-5, atol=1e-5)
