"""The width-1 kernel chosen by measurement: either choice computes the same pass, and the loser's weights go."""
from __future__ import annotations

import json

import torch

from tests.tiny_models import tiny_llama
from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel
from workers.engine.kernel_choice import choose_single_row_kernel, packed_only
from workers.engine.linear import Linear
from workers.engine.mtp_drafter import DraftHead
from workers.mtp_head import HeadSpec, MTPHead


def _logits(model: DecodingModel, prompt: list[int]) -> torch.Tensor:
    lm = CachedLM(model, 1, len(prompt) + 2)
    lm.prefill([prompt], 0)
    return lm.logits(torch.tensor([[prompt[-1]]]))[0, -1]


def test_packed_width_1_pass_matches_the_gemv_pass_and_drops_plain_weights(one_torch_thread):
    model = DecodingModel.prepare(tiny_llama(300, dtype=torch.float32))
    if model.head.packed is None:   # no oneDNN in this torch build: nothing to choose
        return
    prompt = [5, 17, 42, 8, 99, 3]
    want = _logits(model, prompt)
    chosen, timings = choose_single_row_kernel(model, repeats=1)
    assert set(timings) == {"gemv_ms", "packed_ms"} and min(timings.values()) > 0
    torch.testing.assert_close(_logits(chosen, prompt), want, rtol=1e-4, atol=1e-4)
    packed = packed_only(DecodingModel.prepare(tiny_llama(300, dtype=torch.float32)))
    assert packed.head.few_rows is None and all(layer.qkv.few_rows is None for layer in packed.fused.layers)
    torch.testing.assert_close(_logits(packed, prompt), want, rtol=1e-4, atol=1e-4)
    assert model.head.few_rows is not None, "choosing leaves the model it was given untouched"
    head = MTPHead(HeadSpec.for_target(packed.model, "tiny", draft_vocab=64), packed.model)
    draft = DraftHead.prepare(head, packed)
    assert draft.lm_head.few_rows is None and draft.proj.few_rows is None, "a draft head follows the target's choice"
    assert all(layer.gate_up.few_rows is None for layer in draft.block.layers)


def test_a_remembered_choice_is_taken_without_measuring(one_torch_thread, tmp_path, monkeypatch):
    import workers.engine.kernel_choice as kc

    model = DecodingModel.prepare(tiny_llama(300, dtype=torch.float32))
    if model.head.packed is None:
        return
    remembered = tmp_path / "kernel-choice.json"
    chosen, first = choose_single_row_kernel(model, repeats=1, remembered=remembered)
    monkeypatch.setattr(kc, "_pass_s", lambda *a: (_ for _ in ()).throw(AssertionError("measured again")))
    again, second = choose_single_row_kernel(model, repeats=1, remembered=remembered)
    assert second == first and (again.head.few_rows is None) == (chosen.head.few_rows is None)
    remembered.write_text(remembered.read_text().replace(str(first["packed_ms"]), "1e9"))  # plain GEMV "won"
    assert choose_single_row_kernel(model, remembered=remembered)[0].head.few_rows is not None


def test_a_worker_whose_cpu_is_known_to_favour_packed_never_builds_plain_copies(one_torch_thread, model_dir, tmp_path,
                                                                                monkeypatch):
    """Where the remembered choice is packed, loading builds no plain copies (and measures nothing); where it
    is GEMV, both layouts are built and kept."""
    import workers.engine.kernel_choice as kc
    from tests.pipeline_helpers import make_config
    from workers.registry import load_models

    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path))
    config = make_config(model_dir, "in.jsonl", "out")
    if load_models(config, torch.device("cpu")).target.head.packed is None:
        return
    monkeypatch.setattr(kc, "_pass_s", lambda *a: (_ for _ in ()).throw(AssertionError("measured again")))
    built, of = [], Linear.of.__func__
    monkeypatch.setattr(Linear, "of", classmethod(lambda cls, *a, **k: built.append(of(cls, *a, **k)) or built[-1]))
    remembered = tmp_path / "kernel-choice.json"
    key = next(iter(kc._read(remembered)))
    for packed_ms, plain_kept in ((1.0, False), (1e9, True)):
        remembered.write_text(json.dumps({key: {"gemv_ms": 2.0, "packed_ms": packed_ms}}))
        built.clear()
        target = load_models(config, torch.device("cpu")).target
        assert built and all((weights.few_rows is not None) == plain_kept for weights in built)
        assert (target.head.few_rows is not None) == plain_kept
