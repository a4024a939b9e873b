"""Few-row passes on a CPU: a GEMV (the tiled C kernel, else MKL's) or oneDNN's packed kernel, by measurement.

fp32 on a CPU keeps two layouts of every weight (workers/engine/linear.py): the packed one for many
tokens, the tiled (or plain) one for a GEMV at a few tokens, which was faster on some CPUs. On others the GEMV is
the slower, and a width-1 pass then costs more than a width-3 one, which both wastes the plain pass and
misleads the controller. So the choice is measured once per loaded model, on a whole pass (the weights
stream from memory as in decoding, not from cache), and the losing layout is freed. The choice is kept in
the model cache per CPU, torch build, thread count and model shape, so later starts skip the measurement,
and where it says packed, skip the plain copies too (`remembered_timings` before DecodingModel.prepare).
"""
from __future__ import annotations

import copy
import dataclasses
import json
import os
import statistics
import time
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from workers.engine import native
from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel
from workers.engine.linear import Linear

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CONTEXT = 64


def _without_few_rows(weights: Linear) -> Linear:
    return weights._replace(plain=None, tiled=None) if weights.packed is not None else weights


def _pass_s(model: DecodingModel, repeats: int) -> float:
    lm = CachedLM(model, 1, CONTEXT + 2)
    lm.prefill([[1] * CONTEXT], 0)
    token = torch.ones(1, 1, dtype=torch.long)
    times = []
    for _ in range(repeats + 1):
        started = time.perf_counter()
        model.logits(lm.forward(token)[:, -1])
        times.append(time.perf_counter() - started)
    return statistics.median(times[1:])


def packed_only(model: DecodingModel) -> DecodingModel:
    """A copy of the model whose width-1 passes run on the packed kernel (GEMV copies dropped); the model given
    is left as it was."""
    fused = copy.copy(model.fused)
    if fused is not None:
        fused.layers = [layer._replace(**{name: _without_few_rows(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")})
                        for layer in fused.layers]
    return dataclasses.replace(model, fused=fused, head=_without_few_rows(model.head))


def choose_single_row_kernel(model: DecodingModel, repeats: int = 5,
                             remembered: Path | None = None) -> tuple[DecodingModel, dict[str, float]]:
    """Time a width-1 pass both ways (interleaved) and keep the faster; returns the model and the timings (ms).
    With `remembered` (a JSON file), a choice measured before for the same CPU, torch, threads and model shape
    is taken from it instead: the measurement costs seconds at every worker start."""
    if model.fused is None or model.head.few_rows is None:
        return model, {}
    packed = packed_only(model)
    timings = remembered_timings(model, remembered) if remembered else None
    if timings is None:
        plain_s, packed_s = [], []
        for _ in range(2):
            plain_s.append(_pass_s(model, repeats))
            packed_s.append(_pass_s(packed, repeats))
        timings = {"gemv_ms": 1e3 * min(plain_s), "packed_ms": 1e3 * min(packed_s)}
        if remembered:
            _remember(remembered, _choice_key(model), timings)
    return (packed if packed_wins(timings) else model), timings


def packed_wins(timings: dict[str, float]) -> bool:
    return timings["packed_ms"] < timings["gemv_ms"]


def remembered_timings(model: DecodingModel | PreTrainedModel, remembered: Path) -> dict[str, float] | None:
    """The timings measured before for this CPU, torch, threads and model shape, if any (a transformers model
    will do: the key needs only its config and dtype)."""
    return _read(remembered).get(_choice_key(model))


def _choice_key(model: DecodingModel | PreTrainedModel) -> str:
    """What decides which kernel wins: the CPU and its features, torch's build and threads, the GEMV on offer (the
    C kernels' build: a change to their source measures again), and the model's shape and dtype."""
    c = model.config
    gemv = f"tiled {native.build_id()}" if native.available() else "mkl"
    return (f"{native.cpu_id()}|torch {torch.__version__}|{torch.get_num_threads()} threads|{gemv} gemv|{c.num_hidden_layers}x"
            f"{c.hidden_size}x{c.intermediate_size}x{c.vocab_size}|{model.dtype}")


def _read(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _remember(path: Path, key: str, timings: dict[str, float]) -> None:
    """Add one choice; several workers on a node may race, and each write is whole (temp file, then rename)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps({**_read(path), key: timings}, indent=1))
    tmp.replace(path)
