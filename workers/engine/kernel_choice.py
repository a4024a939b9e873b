"""Width-1 passes on a CPU: MKL's GEMV on plain weights or oneDNN's packed kernel, chosen by measurement.

fp32 on a CPU keeps both layouts of every weight (workers/engine/linear.py): the packed one for several
tokens, the plain one for MKL's GEMV at one token, which was faster on some CPUs. On others the GEMV is
the slower, and a width-1 pass then costs more than a width-3 one, which both wastes the plain pass and
misleads the controller. So the choice is measured once per loaded model, on a whole pass (the weights
stream from memory as in decoding, not from cache), and the losing layout is freed.
"""
from __future__ import annotations

import copy
import dataclasses
import statistics
import time

import torch

from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel
from workers.engine.linear import Linear

CONTEXT = 64


def _without_plain(weights: Linear) -> Linear:
    return weights._replace(plain=None) if weights.packed is not None and weights.plain is not None else weights


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
    """A copy of the model whose width-1 passes run on the packed kernel (plain copies dropped); the model given
    is left as it was."""
    fused = copy.copy(model.fused)
    if fused is not None:
        fused.layers = [layer._replace(**{name: _without_plain(getattr(layer, name)) for name in ("qkv", "o", "gate_up", "down")})
                        for layer in fused.layers]
    return dataclasses.replace(model, fused=fused, head=_without_plain(model.head))


def choose_single_row_kernel(model: DecodingModel, repeats: int = 5) -> tuple[DecodingModel, dict[str, float]]:
    """Time a width-1 pass both ways (interleaved) and keep the faster; returns the model and the timings (ms)."""
    if model.fused is None or model.head.plain is None or model.head.packed is None:
        return model, {}
    packed = packed_only(model)
    plain_s, packed_s = [], []
    for _ in range(2):
        plain_s.append(_pass_s(model, repeats))
        packed_s.append(_pass_s(packed, repeats))
    timings = {"gemv_ms": 1e3 * min(plain_s), "packed_ms": 1e3 * min(packed_s)}
    return (packed if timings["packed_ms"] < timings["gemv_ms"] else model), timings
