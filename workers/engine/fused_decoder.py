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
from transformers.models.llama.modeling_llama import rotate_half

from workers.engine.kv_cache import SlotCache
from workers.engine.linear import Linear

SUPPORTED = {"llama", "qwen2"}


def _fuse(linears: list[torch.nn.Linear]) -> Linear:
    """One Linear over the concatenated outputs, with the concatenated bias when every part has one."""
    weight = torch.cat([m.weight.detach() for m in linears], 0)
    biases = [m.bias for m in linears]
    return Linear(weight, torch.cat([b.detach() for b in biases]) if all(b is not None for b in biases) else None)


@dataclass
class _Layer:
    norm1: torch.Tensor
    qkv: Linear
    o: Linear
    norm2: torch.Tensor
    gate_up: Linear
    down: Linear


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
            self.layers.append(_Layer(layer.input_layernorm.weight, _fuse([attn.q_proj, attn.k_proj, attn.v_proj]),
                                      _fuse([attn.o_proj]), layer.post_attention_layernorm.weight,
                                      _fuse([mlp.gate_proj, mlp.up_proj]), _fuse([mlp.down_proj])))

    @staticmethod
    def supports(model: PreTrainedModel) -> bool:
        """Only what this class reproduces exactly: SiLU-gated MLPs without bias, full attention."""
        cfg = model.config
        return (cfg.model_type in SUPPORTED and cfg.hidden_act == "silu" and not getattr(cfg, "mlp_bias", False)
                and not getattr(cfg, "use_sliding_window", False) and not getattr(cfg, "pretraining_tp", 1) > 1)

    def _rms(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """transformers' RMSNorm: one fused op where the dtype makes it bit-identical (fp32/fp64), else its formula."""
        if x.dtype in (torch.float32, torch.float64):
            return torch.rms_norm(x, weight.shape, weight, self.eps)
        x32 = x.float()
        return weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
                 cache: SlotCache) -> torch.Tensor:
        """tokens, positions (n, q); mask (n, 1, q, kv_len) additive, None when every query sees every cached
        position -> final hidden states (n, q, hidden)."""
        n, q = tokens.shape
        h = self.embed(tokens)
        cos, sin = (t.unsqueeze(2) for t in self.rotary(h, positions))           # (n, q, 1, head_dim)
        rotated = self.heads + self.kv_heads                                    # query and key heads, rotated at once
        for index, layer in enumerate(self.layers):
            qkv = layer.qkv(self._rms(h, layer.norm1)).view(n, q, rotated + self.kv_heads, self.head_dim)
            qk = qkv[:, :, :rotated]
            qk = qk * cos + rotate_half(qk) * sin
            query, key = qk[:, :, : self.heads].transpose(1, 2), qk[:, :, self.heads :].transpose(1, 2)
            keys, values = cache.update(key, qkv[:, :, rotated:].transpose(1, 2), index)
            attn = F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, enable_gqa=True)
            h = layer.o.add_to(h, attn.transpose(1, 2).reshape(n, q, -1))
            gate, up = layer.gate_up(self._rms(h, layer.norm2)).chunk(2, -1)
            h = layer.down.add_to(h, F.silu(gate) * up)
        return self._rms(h, self.norm)
