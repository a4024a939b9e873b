"""The memory-bandwidth floor of a target pass: a decoding pass must read every weight it multiplies by
and the KV cache of every live row, so no pass can be faster than those bytes over the machine's memory
bandwidth. Each system's fraction of the floor (floor time per pass / measured time per pass) says how
far it is from the hardware limit, whatever its speed relative to the others."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from jobs.bench.timing import timed

PROBE_MB = {"cpu": 256, "cuda": 2048}   # far beyond the caches, so the probe streams from memory


def measure_bandwidth(device: torch.device, repeats: int = 5, mb: int | None = None) -> float:
    """Bytes per second of reading a large tensor once (a sum: read-only, as a pass reads its weights; a copy
    would also count writes, which share the bus differently), best of `repeats`."""
    n = (mb or PROBE_MB.get(device.type, 256)) * 2**20 // 4
    src = torch.ones(n, device=device)
    src.sum()   # pages the buffer in
    best = min(timed(device, lambda: src.sum())[1] for _ in range(repeats))
    return src.nbytes / best


def weight_bytes(model: torch.nn.Module) -> int:
    """The bytes of weights one pass reads: every parameter once (tied tensors once), less an untied input
    embedding, of which a pass reads only the rows of its tokens."""
    params = {p.data_ptr(): p for p in model.parameters()}
    total = sum(p.numel() * p.element_size() for p in params.values())
    embed, head = model.get_input_embeddings().weight, model.get_output_embeddings().weight
    if embed.data_ptr() != head.data_ptr():
        total -= embed.numel() * embed.element_size()
    return total


def kv_bytes_per_token(config, dtype: torch.dtype) -> int:
    """Keys and values of one cached token across all layers."""
    heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return 2 * config.num_hidden_layers * heads * head_dim * torch.finfo(dtype).bits // 8


def kv_token_reads(passes: int, prompt_tokens: int, generated: int) -> float:
    """Cached tokens a row's passes read in all: its context grows from the prompt to prompt + completion,
    counted as growing evenly over its passes."""
    return passes * (prompt_tokens + generated / 2)


@dataclass(frozen=True)
class Floor:
    """What a pass of this target must read on this machine, and how fast the machine reads."""
    weights: int          # bytes
    kv_per_token: int     # bytes
    bandwidth: float      # bytes per second

    @classmethod
    def measure(cls, model: torch.nn.Module, device: torch.device) -> Floor:
        return cls(weight_bytes(model), kv_bytes_per_token(model.config, model.dtype), measure_bandwidth(device))

    def per_pass(self, passes: int, kv_reads: float, wall_s: float) -> dict[str, float | None]:
        """Per pass: bytes read, the floor time those bytes take, the measured time, and the fraction of the
        floor reached (1.0 = at the bandwidth limit)."""
        if not passes:
            return {"bytes_per_pass": None, "floor_ms_per_pass": None, "ms_per_pass": None, "floor_fraction": None}
        per_pass = self.weights + self.kv_per_token * kv_reads / passes
        floor_s, measured_s = per_pass / self.bandwidth, wall_s / passes
        return {"bytes_per_pass": per_pass, "floor_ms_per_pass": 1e3 * floor_s, "ms_per_pass": 1e3 * measured_s,
                "floor_fraction": floor_s / measured_s if measured_s else None}
