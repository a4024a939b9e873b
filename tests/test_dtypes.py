"""`model.dtype: auto` is the checkpoint's dtype where the device runs it natively, fp32 elsewhere."""
from __future__ import annotations

import pytest
import torch

from tests.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer
from workers import models
from workers.models import load_model, native_dtypes, resolve_dtype

CPU = torch.device("cpu")


def test_explicit_names_win():
    assert resolve_dtype("bfloat16", CPU, torch.float32) == torch.bfloat16
    assert resolve_dtype("float32", CPU, torch.bfloat16) == torch.float32


@pytest.mark.parametrize("bf16_cpu", [True, False])
def test_auto_follows_the_checkpoint_only_where_native(bf16_cpu, monkeypatch):
    monkeypatch.setattr(models, "_cpu_has", lambda feature: bf16_cpu and feature == "avx512_bf16")
    assert (torch.bfloat16 in native_dtypes(CPU)) == bf16_cpu
    assert resolve_dtype("auto", CPU, torch.bfloat16) == (torch.bfloat16 if bf16_cpu else torch.float32)
    assert resolve_dtype("auto", CPU, torch.float16) == torch.float32      # no AMX-FP16
    assert resolve_dtype("auto", CPU, torch.float32) == torch.float32
    assert resolve_dtype("auto", CPU, None) == torch.float32
    assert resolve_dtype("auto", torch.device("mps"), torch.bfloat16) == torch.float32


def test_load_model_reads_the_checkpoint_dtype(tmp_path, monkeypatch):
    monkeypatch.setattr(models, "_cpu_has", lambda feature: feature == "avx512_bf16")
    tok = tiny_tokenizer()
    folder = save_model_dir(tmp_path / "bf16", tiny_llama(len(tok), dtype=torch.bfloat16), tok)
    assert load_model(str(folder), "auto", CPU).dtype == torch.bfloat16
    assert load_model(str(folder), "float32", CPU).dtype == torch.float32
