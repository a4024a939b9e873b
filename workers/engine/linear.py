"""Matmuls against weights laid out once, at load time, for the kernel that streams them fastest.

On CPU in fp32 and bf16, oneDNN's linear over a weight reordered ahead of time ("packed") costs about
as much for 9 rows as for 1: all 30 SmolLM2-135M layers plus its head took 44 ms for 9 rows against
40 ms for 1, where MKL's sgemm on a plain (in, out) weight took 99 ms for 9 rows. A verify pass of
width 9, or a batch of rows, is then nearly free next to a single-token pass. For a single fp32 row
MKL's GEMV on the plain (in, out) layout is still ~20% faster (35 ms), so fp32 keeps both layouts (the
weights' memory doubles for the fastest pass at every width); bf16 is fastest packed at every width
and keeps only that. Other dtypes (fp64 in the exactness tests) and other devices keep one plain layout.
Where the C kernel of workers/engine/native.py builds, fp32's second layout is its tiled one instead of
the plain one: it reads the weights ~1.3x faster than either library kernel at one row and wins up to 64 rows.
"""
from __future__ import annotations

from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F

from workers.engine import native

PACK_ROWS = 64  # the row count oneDNN lays the weight out for; measured as good as 9 or 16 for 1..64 rows


def packs(weight: torch.Tensor) -> bool:
    """Whether `weight` gets the oneDNN packed layout (CPU, oneDNN built in, fp32, or bf16 where oneDNN has bf16
    kernels for this CPU: AVX-512 BW/VL/DQ or AVX-NE-CONVERT; an AVX2 CPU keeps bf16 weights plain)."""
    if weight.device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    return weight.dtype == torch.float32 or (weight.dtype == torch.bfloat16 and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def _plain(x: torch.Tensor, plain: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor | None) -> torch.Tensor:
    out = x @ plain
    out = out if bias is None else out + bias
    return out if residual is None else residual + out


def _packed(x: torch.Tensor, packed: torch.Tensor, plain: torch.Tensor | None, bias: torch.Tensor | None,
            residual: torch.Tensor | None) -> torch.Tensor:
    """oneDNN for several rows (the residual add is the GEMM's epilogue: one kernel, same rounding); MKL's
    GEMV on the plain layout for one row where it is kept."""
    if plain is not None and x.numel() == x.shape[-1]:
        return _plain(x, plain, bias, residual)
    if residual is None:
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")
    return torch.ops.mkldnn._linear_pointwise.binary(x, residual, packed, bias, "add")


@torch.library.custom_op("specbatch::packed_linear", mutates_args=())
def packed_linear(x: torch.Tensor, packed: torch.Tensor, plain: Optional[torch.Tensor], bias: Optional[torch.Tensor],
                  residual: Optional[torch.Tensor]) -> torch.Tensor:
    """The packed matmul as one opaque op for torch.compile, which cannot lower oneDNN's packed weights itself."""
    return _packed(x, packed, plain, bias, residual)


@packed_linear.register_fake
def _(x, packed, plain, bias, residual):
    return x.new_empty(*x.shape[:-1], packed.shape[0])


class Linear(NamedTuple):
    """y = x @ weight.T + bias (+ residual) for a (out, in) weight. A tuple of tensors, so that a compiled
    function taking one compiles once for every layer of the same shape."""
    packed: torch.Tensor | None      # oneDNN layout
    plain: torch.Tensor | None       # (in, out)
    bias: torch.Tensor | None
    tiled: torch.Tensor | None = None  # (out / 16, in, 16) for the C kernel of few rows

    @property
    def few_rows(self) -> torch.Tensor | None:
        """The layout kept beside the packed one for few-row passes (tiled or plain), if any."""
        return None if self.packed is None else self.tiled if self.tiled is not None else self.plain

    @classmethod
    def of(cls, weight: torch.Tensor, bias: torch.Tensor | None = None, gemv: bool = True) -> Linear:
        """`gemv=False`: no few-row copy beside a packed one (a remembered kernel choice says packed wins at width 1;
        the copies cost about 0.9 s of a SmolLM2 worker's start)."""
        weight = weight.detach()
        bias = None if bias is None else bias.detach()
        packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if packs(weight) else None
        second = gemv and packed is not None and weight.dtype == torch.float32
        if second and native.available():
            return cls(packed, None, bias, native.tile(weight))
        plain = packed is None or second
        plain_weight = None if not plain else weight.t().contiguous() if weight.device.type == "cpu" else weight.t()
        return cls(packed, plain_weight, bias)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm: one fused op where the dtype makes it bit-identical (fp32/fp64), else its formula."""
    if x.dtype in (torch.float32, torch.float64):
        return torch.rms_norm(x, weight.shape, weight, eps)
    x32 = x.float()
    return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def _tiled(x: torch.Tensor, weights: Linear, residual: torch.Tensor | None = None, **prologue) -> torch.Tensor | None:
    """The C kernel's product where it serves these rows (tiled layout kept, at most native.MAX_ROWS rows,
    eager), else None; `prologue`: its norm or gate on the input (native.tiled_linear)."""
    if weights.tiled is None or x.numel() > native.MAX_ROWS * x.shape[-1] or torch.compiler.is_compiling():
        return None
    return native.tiled_linear(x, weights.tiled, weights.packed.shape[0], weights.bias, residual, **prologue)


def norm_linear(x: torch.Tensor, norm: torch.Tensor, eps: float, weights: Linear) -> torch.Tensor:
    """linear(rms_norm(x, norm, eps), weights), the norm inside the C kernel where that serves these rows."""
    y = _tiled(x, weights, norm=norm, eps=eps)
    return y if y is not None else linear(rms_norm(x, norm, eps), weights)


def gated_linear(gate_up: torch.Tensor, weights: Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    """linear(silu(gate) * up, weights, residual) for gate_up = [gate | up], the gate inside the C kernel where
    that serves these rows."""
    y = _tiled(gate_up, weights, residual, gated=True)
    if y is not None:
        return y
    gate, up = gate_up.chunk(2, -1)
    return linear(F.silu(gate) * up, weights, residual)


def linear(x: torch.Tensor, weights: Linear, residual: torch.Tensor | None = None) -> torch.Tensor:
    if weights.packed is None:
        return _plain(x, weights.plain, weights.bias, residual)
    y = _tiled(x, weights, residual)
    if y is not None:
        return y
    if torch.compiler.is_compiling():
        return packed_linear(x, weights.packed, weights.plain, weights.bias, residual)
    return _packed(x, weights.packed, weights.plain, weights.bias, residual)  # eager: skip the custom op's dispatch cost
