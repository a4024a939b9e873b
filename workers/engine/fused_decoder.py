"""A lean forward pass for Llama-family decoders (Llama, Qwen2, SmolLM): the same math as
transformers' modules with four matmuls per layer (fused QKV, fused gate/up) and no module overhead.

Decoding at small batch is dominated by per-op overhead and GEMV bandwidth, so fewer, larger matmuls
against contiguous (in, out) weights pay off. The fused weights are this object's own copies: the
transformers model is left untouched (a caller that keeps only the FusedDecoder frees the originals).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from transformers import PreTrainedModel
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from workers.engine.kv_cache import SlotCache

SUPPORTED = {"llama", "qwen2"}


def _fuse(linears: list[torch.nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One contiguous (in, sum(out)) weight, and the concatenated bias when every Linear has one."""
    fused = torch.cat([m.weight.detach() for m in linears], 0).t().contiguous()
    biases = [m.bias for m in linears]
    bias = torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None
    return fused, bias


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: torch.Tensor
    qkv_bias: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None
    norm2: torch.Tensor
    gate_up: torch.Tensor
    down: torch.Tensor


class FusedDecoder:
    """Runs tokens through the decoder into a SlotCache; returns the final hidden states."""

    def __init__(self, model: PreTrainedModel):
        cfg, decoder = model.config, model.get_decoder()
        self.heads, self.kv_heads = cfg.num_attention_heads, cfg.num_key_value_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps, self.embed, self.norm, self.rotary = cfg.rms_norm_eps, decoder.embed_tokens, decoder.norm.weight, decoder.rotary_emb
        self.layers = []
        for layer in decoder.layers:
            attn, mlp = layer.self_attn, layer.mlp
            qkv, qkv_bias = _fuse([attn.q_proj, attn.k_proj, attn.v_proj])
            gate_up, _ = _fuse([mlp.gate_proj, mlp.up_proj])
            o, o_bias = _fuse([attn.o_proj])
            down, _ = _fuse([mlp.down_proj])
            self.layers.append(_Layer(layer.input_layernorm.weight, qkv, qkv_bias, o, o_bias,
                                      layer.post_attention_layernorm.weight, gate_up, down))

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """Only what this class reproduces exactly: SiLU-gated MLPs without bias, full attention."""
        cfg = model.config
        return (cfg.model_type in SUPPORTED and cfg.hidden_act == "silu" and not getattr(cfg, "mlp_bias", False)
                and not getattr(cfg, "use_sliding_window", False) and not getattr(cfg, "pretraining_tp", 1) > 1)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor, cache: SlotCache) -> torch.Tensor:
        """tokens, positions (n, q); mask (n, 1, q, kv_len) additive -> final hidden states (n, q, hidden)."""
        n, q = tokens.shape
        h = self.embed(tokens)
        cos, sin = self.rotary(h, positions)
        split = (self.heads * self.head_dim, self.kv_heads * self.head_dim, self.kv_heads * self.head_dim)
        for index, layer in enumerate(self.layers):
            x = self._rms(h, layer.norm1)
            qkv = x @ layer.qkv
            if layer.qkv_bias is not None:
                qkv = qkv + layer.qkv_bias
            query, key, value = qkv.split(split, -1)
            query = query.view(n, q, self.heads, self.head_dim).transpose(1, 2)
            key = key.view(n, q, self.kv_heads, self.head_dim).transpose(1, 2)
            value = value.view(n, q, self.kv_heads, self.head_dim).transpose(1, 2)
            query, key = apply_rotary_pos_emb(query, key, cos, sin)
            keys, values = cache.update(key, value, index)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
            h = h + attn.transpose(1, 2).reshape(n, q, -1) @ layer.o
            if layer.o_bias is not None:
                h = h + layer.o_bias
            x = self._rms(h, layer.norm2)
            gate, up = (x @ layer.gate_up).chunk(2, -1)
            h = h + (F.silu(gate) * up) @ layer.down
        return self._rms(h, self.norm)
