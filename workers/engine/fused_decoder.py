"""A lean forward pass for Llama-family decoders (Llama, Qwen2, SmolLM): the same math as
transformers' modules with four matmuls per layer (fused QKV, fused gate/up) and no module overhead.

Decoding at small batch is dominated by per-op overhead and GEMV bandwidth, so fewer, larger matmuls
against weights laid out for their kernel (workers/engine/linear.py) pay off. The fused and laid-out weights are
this object's own copies (a weight already in its kernel's layout is shared); the model itself is left untouched.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, NamedTuple

import torch
import torch.nn.functional as F

from workers.engine import native
from workers.engine.kv_cache import SlotCache
from workers.engine.linear import Linear, gated_linear, linear, norm_linear, rms_norm

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from workers.engine.checkpoint import CheckpointLM

SUPPORTED = {"llama", "qwen2"}


def _fuse(linears: list[torch.nn.Linear], gemv: bool) -> Linear:
    """One Linear over the concatenated outputs, with the concatenated bias when every part has one (a single part
    is used as it is: copying it would cost start-up time and memory for nothing)."""
    def joined(parts: list[torch.Tensor]) -> torch.Tensor:
        return parts[0].detach() if len(parts) == 1 else torch.cat([p.detach() for p in parts], 0)

    biases = [m.bias for m in linears]
    return Linear.of(joined([m.weight for m in linears]), joined(biases) if all(b is not None for b in biases) else None, gemv)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """(x1, x2) -> (-x2, x1) over the last dimension's halves: RoPE's rotation, as transformers writes it."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class _Layer(NamedTuple):
    norm1: torch.Tensor
    qkv: Linear
    o: Linear
    norm2: torch.Tensor
    gate_up: Linear
    down: Linear


def _attention_inputs(h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layer: _Layer, heads: int, kv_heads: int,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Norm, fused QKV, and rotary on query and key heads at once -> query, key, value (n, heads, q, head_dim)."""
    n, q, _ = h.shape
    qkv = norm_linear(h, layer.norm1, eps, layer.qkv).view(n, q, heads + 2 * kv_heads, -1)
    qk = qkv[:, :, : heads + kv_heads]
    qk = qk * cos + rotate_half(qk) * sin
    return qk[:, :, :heads].transpose(1, 2), qk[:, :, heads:].transpose(1, 2), qkv[:, :, heads + kv_heads :].transpose(1, 2)


def _attention_out_and_mlp(h: torch.Tensor, attn: torch.Tensor, layer: _Layer, eps: float) -> torch.Tensor:
    """Output projection of attn (n, q, heads * head_dim) and the gated MLP, each added to the residual stream."""
    h = linear(attn, layer.o, h)
    return gated_linear(norm_linear(h, layer.norm2, eps, layer.gate_up), layer.down, h)


class FusedDecoder:
    """Runs tokens through the decoder into a SlotCache; returns the final hidden states.

    With `compile`, the two halves of a layer around the cache write and attention are compiled once
    (weights are arguments, so every layer shares one graph; shapes are dynamic, so rows, width and
    cache length never recompile) and the elementwise work between matmuls fuses into a few kernels."""

    def __init__(self, layers, *, heads: int, kv_heads: int, eps: float, norm: torch.Tensor, rotary: torch.nn.Module,
                 embed: torch.nn.Module | None = None, compile: bool = False, gemv: bool = True):
        """`layers`: transformers-style decoder layers (a model's, or an MTP head's block); `norm` the final norm's
        weight; `embed` the token embedding (None: the caller feeds hidden states to `run`)."""
        self.heads, self.kv_heads, self.eps, self.embed, self.norm, self.rotary = heads, kv_heads, eps, embed, norm, rotary
        self.layers = []
        for layer in layers:
            attn, mlp = layer.self_attn, layer.mlp
            self.layers.append(_Layer(layer.input_layernorm.weight, _fuse([attn.q_proj, attn.k_proj, attn.v_proj], gemv),
                                      _fuse([attn.o_proj], gemv), layer.post_attention_layernorm.weight,
                                      _fuse([mlp.gate_proj, mlp.up_proj], gemv), _fuse([mlp.down_proj], gemv)))
        self.compiled = compile
        wrap = (lambda f: torch.compile(f, dynamic=True)) if compile else (lambda f: f)
        self._before_attention, self._after_attention = wrap(_attention_inputs), wrap(_attention_out_and_mlp)

    @classmethod
    def of(cls, model: PreTrainedModel | CheckpointLM, compile: bool = False, gemv: bool = True) -> FusedDecoder:
        cfg, decoder = model.config, model.get_decoder()
        return cls(decoder.layers, heads=cfg.num_attention_heads, kv_heads=cfg.num_key_value_heads, eps=cfg.rms_norm_eps,
                   norm=decoder.norm.weight, rotary=decoder.rotary_emb, embed=decoder.embed_tokens, compile=compile,
                   gemv=gemv)

    def _native_attention(self, h: torch.Tensor, cache: SlotCache) -> bool:
        """Whether this pass's attention runs in one C call per layer (native.decode_attention): a few fp32 rows
        on a CPU, eagerly, over cache buffers the prefill has already allocated."""
        return (not self.compiled and h.dtype == torch.float32 and h.device.type == "cpu"
                and h.shape[0] * h.shape[1] <= native.MAX_ROWS and len(cache.keys) == len(self.layers)
                and native.available())

    @staticmethod
    def supports(model: PreTrainedModel | CheckpointLM) -> bool:
        """Only what this class reproduces exactly: SiLU-gated MLPs without bias, full attention."""
        cfg = model.config
        return (cfg.model_type in SUPPORTED and cfg.hidden_act == "silu" and not getattr(cfg, "mlp_bias", False)
                and not getattr(cfg, "use_sliding_window", False) and not getattr(cfg, "pretraining_tp", 1) > 1)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: SlotCache) -> torch.Tensor:
        """tokens, positions (n, q); mask (n, 1, q, kv_len) additive, None when every query sees every cached
        position -> final hidden states (n, q, hidden)."""
        return self.run(self.embed(tokens), positions, mask, cache)

    def run(self, h: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None, cache: SlotCache) -> torch.Tensor:
        """The layers and the final norm over input states h (n, q, hidden), as __call__ over embedded tokens."""
        cos, sin = self.rotary(h, positions)                                      # (n, q, head_dim)
        if self._native_attention(h, cache):
            for index, layer in enumerate(self.layers):
                qkv = norm_linear(h, layer.norm1, self.eps, layer.qkv)
                attn = native.decode_attention(qkv, cos, sin, positions, cache.keys[index], cache.values[index],
                                               cache.rows.start, self.heads, self.kv_heads)
                h = self._after_attention(h, attn, layer, self.eps)
            return rms_norm(h, self.norm, self.eps)
        cos, sin = cos.unsqueeze(2), sin.unsqueeze(2)
        # A prompt fed from an empty cache sees exactly the causal triangle: the kernel then skips the blocks
        # above it instead of reading the mask over all of them (about half of a long prefill's attention).
        causal = mask is not None and cache.kv_len == h.shape[1]
        for index, layer in enumerate(self.layers):
            query, key, value = self._before_attention(h, cos, sin, layer, self.heads, self.kv_heads, self.eps)
            keys, values = cache.update(key, value, index)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=None if causal else mask,
                                                  is_causal=causal, enable_gqa=True)
            h = self._after_attention(h, attn.transpose(1, 2).flatten(2), layer, self.eps)
        return rms_norm(h, self.norm, self.eps)
