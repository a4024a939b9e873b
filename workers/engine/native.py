"""C kernels for the few-row passes of decoding on a CPU (csrc/): a matmul that reads the weights at the
memory's speed, and a layer's attention over the slot cache in one call.

At one to a few rows a decode pass is a matrix-vector product per weight, bound by how fast the weights
stream from memory. On this repo's 2-core CPU MKL's GEMV reads them at ~17 GB/s and oneDNN's packed kernel
at ~18, while a read-only probe reaches ~26-30: the C kernel over weights tiled by 16 outputs reads at ~25
(the 30 SmolLM2 layers' matmuls: 1.48x faster than packed for one row, 1.31x at 16 rows, level at 64).
With the RMS norm and SiLU gate folded into it and attention in one call per layer, a width-1 pass of
SmolLM2 takes 19.3 ms against 37.6 on torch's kernels, about the 19.4 ms that reading its 538 MB takes, and
passes of 24-64 tokens run 1.2-1.5x faster than on oneDNN and torch's attention. Both kernels work in vectors of
the CPU's own width (csrc/: AVX-512, AVX2 or NEON): on an AVX2-only AMD EPYC, 16-float vectors spilled to the stack,
and a width-1 pass took 44-48 ms where it now takes 24 (its 22 GB/s floor: 24.5).

The kernels are compiled once per CPU and source (under a second with the system's C compiler) into the
specbatch cache and loaded with ctypes; their OpenMP calls share torch's own thread pool. Without a C compiler,
or with SPECBATCH_NATIVE=0, `available()` is False and decoding keeps torch's kernels.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
from pathlib import Path

import torch

from workers.model_paths import cache_root

CSRC = Path(__file__).parent / "csrc"
SOURCES = sorted(CSRC.glob("*.c"))
HEADERS = sorted(CSRC.glob("*.h"))   # part of the build's identity, not of its command line
TILE = 16
MAX_ROWS = 64  # up to here the C kernels win (whole SmolLM2 passes against oneDNN + SDPA: 1.3-1.5x at 24-64 rows);
# the matmul alone ties oneDNN's packed kernel at 64 rows and loses beyond
log = logging.getLogger(__name__)


@functools.cache
def cpuinfo() -> list[str]:
    """/proc/cpuinfo's lines (none where it cannot be read)."""
    try:
        return Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return []


def _cpu_signature() -> str:
    """-march=native code runs only where the CPU has the same features."""
    lines = cpuinfo() or [os.uname().machine]
    return "|".join(next((line for line in lines if line.startswith(key)), "") for key in ("model name", "flags"))


def _compile(compiler: str, out: Path) -> None:
    tmp = out.with_name(f".{out.name}.{os.getpid()}.tmp")
    subprocess.run([compiler, "-O3", "-march=native", "-fopenmp", "-shared", "-fPIC", *map(str, SOURCES), "-o", str(tmp)],
                   check=True, capture_output=True, text=True, timeout=120)
    tmp.replace(out)  # whole or absent: workers on one node may race, the last rename wins with the same file


def vector_isa() -> str:
    """The widest vector instructions this CPU has, which set the kernels' vector width (csrc/)."""
    flags = set(next((line.split(":", 1)[1].split() for line in cpuinfo() if line.startswith(("flags", "Features"))), []))
    return next((name for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("asimd", "NEON"), ("sse2", "SSE2"))
                 if flag in flags), "no vector ISA found")


def cpu_name() -> str:
    return next((line.split(":", 1)[1].strip() for line in cpuinfo() if line.startswith("model name")), "unknown cpu")


def cpu_id() -> str:
    """This CPU's name and a digest of its features: KVM guests of different generations can share a name."""
    return f"{cpu_name()} {hashlib.sha256(_cpu_signature().encode()).hexdigest()[:8]}"


def build_id() -> str | None:
    """The kernels' identity: their sources, this CPU's features and the compiler (None: no compiler or disabled)."""
    compiler = _compiler()
    if compiler is None:
        return None
    key = hashlib.sha256(b"".join(map(Path.read_bytes, SOURCES + HEADERS)) + _cpu_signature().encode() + compiler.encode())
    return key.hexdigest()[:16]


def _compiler() -> str | None:
    """$CC (default cc) on the PATH, unless SPECBATCH_NATIVE=0 switches the kernels off."""
    if os.environ.get("SPECBATCH_NATIVE", "1") == "0":
        return None
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        log.warning("no C compiler (cc) found: decoding uses torch's kernels, about 1.9x slower at one row on a CPU")
    return compiler


@functools.cache
def _library() -> ctypes.CDLL | None:
    compiler = _compiler()
    if compiler is None:
        return None
    path = cache_root() / "native" / f"kernels-{build_id()}.so"
    try:
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            _compile(compiler, path)
        library = ctypes.CDLL(str(path))
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", "") or error
        log.warning("could not build %s (%s): decoding uses torch's kernels", [str(s) for s in SOURCES], detail)
        return None
    pointer, size, integer = ctypes.c_void_p, ctypes.c_long, ctypes.c_int
    library.tiled_linear.argtypes = [pointer, size, size, pointer, size, pointer, pointer, pointer, ctypes.c_float,
                                     integer, pointer, integer]
    library.decode_attention.argtypes = [pointer, size, size, size, size, size, pointer, pointer, pointer, pointer,
                                         pointer, size, size, pointer, integer]
    library.tiled_linear.restype = library.decode_attention.restype = None
    return library


def available() -> bool:
    return _library() is not None


def tile(weight: torch.Tensor) -> torch.Tensor:
    """(out, in) -> (blocks, in, 16): each block holds 16 outputs' weights interleaved by input (zero-padded)."""
    out, features = weight.shape
    weight = weight.detach()
    if out % TILE:  # one copy, not two, where the outputs fill whole tiles (every SmolLM2 and Llama weight)
        weight = torch.nn.functional.pad(weight, (0, 0, 0, -out % TILE))
    return weight.view(-1, TILE, features).transpose(1, 2).contiguous()


def tiled_linear(x: torch.Tensor, tiled: torch.Tensor, out_features: int, bias: torch.Tensor | None = None,
                 residual: torch.Tensor | None = None, norm: torch.Tensor | None = None, eps: float = 0.0,
                 gated: bool = False) -> torch.Tensor:
    """x (..., in) fp32 on CPU -> f(x) @ weight.T (+ bias) (+ residual), (..., out_features), where f is the
    identity, transformers' RMS norm with weight `norm`, or with `gated` silu(gate) * up of x = [gate | up]."""
    features = tiled.shape[1]
    if x.shape[-1] != features * (2 if gated else 1):
        raise ValueError(f"input of {x.shape[-1]} features for a weight of {features}{' (gated)' if gated else ''}")
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    y = torch.empty(*x.shape[:-1], out_features, dtype=x.dtype)
    res = None if residual is None else residual.contiguous()
    _library().tiled_linear(rows.data_ptr(), rows.shape[0], features, tiled.data_ptr(), out_features,
                            None if bias is None else bias.data_ptr(), None if res is None else res.data_ptr(),
                            None if norm is None else norm.contiguous().data_ptr(), eps, gated, y.data_ptr(),
                            torch.get_num_threads())
    return y


def decode_attention(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, positions: torch.Tensor,
                     keys: torch.Tensor, values: torch.Tensor, first: int, heads: int, kv_heads: int) -> torch.Tensor:
    """Rotary, cache write and causal attention for qkv (n, q, (heads + 2 kv_heads) * d) fp32 on CPU, whose
    rows live in slots first.. of this layer's cache buffers keys, values (slots, kv_heads, capacity, d);
    cos, sin (n, q, d); positions (n, q) -> attention output (n, q, heads * d)."""
    n, q, _ = qkv.shape
    d = keys.shape[-1]
    qkv, cos, sin = qkv.contiguous(), cos.contiguous(), sin.contiguous()
    positions = positions.to(torch.long).contiguous()
    if not (keys.is_contiguous() and values.is_contiguous()) or first + n > keys.shape[0]:
        raise ValueError("decode_attention needs whole contiguous cache buffers holding the rows' slots")
    out = torch.empty(n, q, heads * d, dtype=qkv.dtype)
    _library().decode_attention(qkv.data_ptr(), n, q, heads, kv_heads, d, cos.data_ptr(), sin.data_ptr(),
                                positions.data_ptr(), keys.data_ptr(), values.data_ptr(), keys.shape[2], first,
                                out.data_ptr(), torch.get_num_threads())
    return out
