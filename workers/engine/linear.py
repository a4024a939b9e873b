"""Matmuls against weights laid out once, at load time, for the kernel that streams them fastest.

On CPU in fp32 and bf16, oneDNN's linear over a weight reordered ahead of time ("packed") costs about
as much for 9 rows as for 1: all 30 SmolLM2-135M layers plus its head took 44 ms for 9 rows against
40 ms for 1, where MKL's sgemm on a plain (in, out) weight took 99 ms for 9 rows. A verify pass of
width 9, or a batch of rows, is then nearly free next to a single-token pass. For a single fp32 row
MKL's GEMV on the plain (in, out) layout is still ~20% faster (35 ms), so fp32 keeps both layouts (the
weights' memory doubles for the fastest pass at every width); bf16 is fastest packed at every width
and keeps only that. Other dtypes (fp64 in the exactness tests) and other devices keep one plain layout.
"""
from __future__ import annotations

import torch

PACK_ROWS = 64  # the row count oneDNN lays the weight out for; measured as good as 9 or 16 for 1..64 rows


def packs(weight: torch.Tensor) -> bool:
    """Whether `weight` gets the oneDNN packed layout (CPU, fp32 or bf16, oneDNN built in)."""
    return (weight.device.type == "cpu" and weight.dtype in (torch.float32, torch.bfloat16)
            and torch.backends.mkldnn.is_available())


class Linear:
    """y = x @ weight.T + bias for a (out, in) weight, optionally added to a residual in the same kernel."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        weight = weight.detach()
        self.weight = weight  # the caller's (out, in) tensor, shared, not copied
        self.bias = None if bias is None else bias.detach()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, PACK_ROWS) if packs(weight) else None
        plain = self.packed is None or weight.dtype == torch.float32
        self.plain = None if not plain else weight.t().contiguous() if weight.device.type == "cpu" else weight.t()

    @property
    def in_out(self) -> torch.Tensor:
        """The weight as an (in, out) matrix: the contiguous copy where there is one, else a view."""
        return self.plain if self.plain is not None else self.weight.t()

    def _use_packed(self, x: torch.Tensor) -> bool:
        return self.packed is not None and (self.plain is None or x.numel() != x.shape[-1])

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self._use_packed(x):
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        out = x @ self.plain
        return out if self.bias is None else out + self.bias

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """residual + (x @ weight.T + bias); on oneDNN the add is the GEMM's epilogue (one kernel, same rounding)."""
        if self._use_packed(x):
            return torch.ops.mkldnn._linear_pointwise.binary(x, residual, self.packed, self.bias, "add")
        return residual + self(x)
