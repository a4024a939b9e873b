"""Llama-family weights read straight from a safetensors folder, without transformers' modeling code.

A worker needs only the weights: the fused decoder (fused_decoder.py) runs the forward pass. Importing
transformers' modeling code costs a worker process 4-6 s on a small CPU, more than loading the demo model
itself, and most of a small job's time before its first token. Checkpoints the fused decoder reproduces
exactly (`readable`) load here into modules named as in the checkpoint and in transformers, so the same
code reads either; every other checkpoint goes through transformers (workers/models.py).
"""
from __future__ import annotations

import json
import mmap
from pathlib import Path
from types import SimpleNamespace

import torch
from torch import nn

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM"}
ROPE_TYPES = {"default"}


def read_config(folder: Path) -> dict:
    return json.loads((folder / "config.json").read_text())


def rope_parameters(config: dict) -> dict:
    """The rotary settings, as transformers 5 writes them (`rope_parameters`) or as older configs do."""
    legacy = {**(config.get("rope_scaling") or {}), "rope_theta": config.get("rope_theta", 10000.0)}
    rope = dict(config.get("rope_parameters") or legacy)
    rope.setdefault("rope_type", rope.pop("type", "default"))
    return rope


def readable(folder: Path, trust_remote_code: bool = False) -> bool:
    """Whether this module loads the checkpoint at `folder` exactly as transformers would for decoding:
    a Llama or Qwen2 causal LM with plain rotary embeddings, SiLU MLPs without bias and full attention,
    stored as safetensors."""
    config = read_config(folder)
    rope = rope_parameters(config)
    model_type = config.get("model_type")
    return (not trust_remote_code and model_type in ARCHITECTURES
            and config.get("architectures", [ARCHITECTURES[model_type]]) == [ARCHITECTURES[model_type]]
            and rope["rope_type"] in ROPE_TYPES and rope.get("partial_rotary_factor", 1.0) == 1.0
            and config.get("hidden_act", "silu") == "silu" and not config.get("mlp_bias", False)
            and not config.get("use_sliding_window", False) and config.get("pretraining_tp", 1) == 1
            and bool(_weight_files(folder)))


def _weight_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        return [folder / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    return [folder / "model.safetensors"] if (folder / "model.safetensors").is_file() else []


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def mapped(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a safetensors file as views of the file, mapped copy-on-write: nothing is read until it is
    used, the pages are the page cache's (shared by every worker on the node, and evictable), a write stays
    private. safetensors' own loaders copy every tensor into fresh memory."""
    with open(path, "rb") as f:
        size = int.from_bytes(f.read(8), "little")
        header = json.loads(f.read(size))
        buffer = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
    tensors = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        begin, end = info["data_offsets"]
        dtype = _DTYPES[info["dtype"]]
        count = (end - begin) // dtype.itemsize
        flat = torch.frombuffer(buffer, dtype=dtype, count=count, offset=8 + size + begin) if count else torch.empty(0, dtype=dtype)
        tensors[name] = flat.view(info["shape"])
    return tensors


def _config(raw: dict, folder: Path, dtype: torch.dtype) -> SimpleNamespace:
    """config.json's fields with the defaults transformers' Llama/Qwen2 configs give the ones it omits."""
    heads = raw["num_attention_heads"]
    defaults = {"num_key_value_heads": heads, "head_dim": raw["hidden_size"] // heads, "rms_norm_eps": 1e-6,
                "attention_bias": False, "mlp_bias": False, "tie_word_embeddings": False, "hidden_act": "silu",
                "max_position_embeddings": 2048, "pretraining_tp": 1}
    fields = {**defaults, **{k: v for k, v in raw.items() if v is not None}}
    return SimpleNamespace(**{**fields, "rope_parameters": rope_parameters(raw), "dtype": dtype, "_name_or_path": str(folder)})


def _generation_config(folder: Path, config: SimpleNamespace) -> SimpleNamespace:
    """generation_config.json, or the model config's token ids as transformers derives it when there is none."""
    path = folder / "generation_config.json"
    fields = json.loads(path.read_text()) if path.is_file() else {
        key: getattr(config, key) for key in ("bos_token_id", "eos_token_id", "pad_token_id") if hasattr(config, key)}
    return SimpleNamespace(**{"eos_token_id": None, **fields})


class RotaryEmbedding(nn.Module):
    """Plain RoPE: the cosines and sines of position x inverse frequency, computed as transformers does."""

    def __init__(self, theta: float, dim: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim)), persistent=False)

    def forward(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x (for its device and dtype), positions (n, q) -> cos, sin (n, q, dim)."""
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def _linear(inputs: int, outputs: int, bias: bool) -> nn.Linear:
    return nn.Linear(inputs, outputs, bias=bias, device="meta")


class _Attention(nn.Module):
    def __init__(self, c: SimpleNamespace, qkv_bias: bool):
        super().__init__()
        q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
        self.q_proj, self.k_proj, self.v_proj = (_linear(c.hidden_size, n, qkv_bias) for n in (q, kv, kv))
        self.o_proj = _linear(q, c.hidden_size, c.attention_bias)


class _MLP(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.gate_proj, self.up_proj = (_linear(c.hidden_size, c.intermediate_size, False) for _ in range(2))
        self.down_proj = _linear(c.intermediate_size, c.hidden_size, False)


class _Layer(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        self.self_attn = _Attention(c, c.attention_bias or c.model_type == "qwen2")  # Qwen2 always biases q, k, v
        self.mlp = _MLP(c)
        self.input_layernorm, self.post_attention_layernorm = (nn.RMSNorm(c.hidden_size, c.rms_norm_eps, device="meta")
                                                               for _ in range(2))


class _Decoder(nn.Module):
    def __init__(self, c: SimpleNamespace):
        super().__init__()
        # Given its (meta) weight, Embedding skips its random init, whose meta kernel imports torch._dynamo (~2 s).
        self.embed_tokens = nn.Embedding(c.vocab_size, c.hidden_size, _weight=torch.empty(c.vocab_size, c.hidden_size, device="meta"))
        self.layers = nn.ModuleList(_Layer(c) for _ in range(c.num_hidden_layers))
        self.norm = nn.RMSNorm(c.hidden_size, c.rms_norm_eps, device="meta")
        self.rotary_emb = RotaryEmbedding(c.rope_parameters["rope_theta"], c.head_dim)


class CheckpointLM(nn.Module):
    """A decoder-only LM's weights under the checkpoint's own names, with the accessors the engine reads
    (config, generation_config, get_decoder, get_input_embeddings, get_output_embeddings). No forward pass:
    the fused decoder is this model's forward."""

    def __init__(self, config: SimpleNamespace, generation_config: SimpleNamespace):
        super().__init__()
        self.config, self.generation_config = config, generation_config
        self.model = _Decoder(config)
        self.lm_head = _linear(config.hidden_size, config.vocab_size, False)

    @classmethod
    def load(cls, folder: Path, dtype: torch.dtype, device: torch.device) -> CheckpointLM:
        """The weights at `folder` in `dtype` on `device`; a tied LM head shares the embedding's storage."""
        config = _config(read_config(folder), folder, dtype)
        lm = cls(config, _generation_config(folder, config))
        weights = {}
        for path in _weight_files(folder):
            weights.update({name: tensor.to(device=device, dtype=dtype) for name, tensor in mapped(path).items()
                            if not name.endswith(".inv_freq")})
        if "lm_head.weight" not in weights and config.tie_word_embeddings:
            weights["lm_head.weight"] = weights["model.embed_tokens.weight"]
        result = lm.load_state_dict(weights, strict=False, assign=True)
        if result.missing_keys or result.unexpected_keys:
            raise ValueError(f"{folder} does not hold a plain {config.model_type} checkpoint: missing "
                             f"{result.missing_keys[:3]}, unexpected {result.unexpected_keys[:3]}")
        if config.tie_word_embeddings:
            lm.lm_head.weight = lm.model.embed_tokens.weight
        lm.model.rotary_emb.to(device)
        return lm.eval().requires_grad_(False)

    @property
    def device(self) -> torch.device:
        return self.lm_head.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.lm_head.weight.dtype

    def get_decoder(self) -> _Decoder:
        return self.model

    def get_input_embeddings(self) -> nn.Embedding:
        return self.model.embed_tokens

    def get_output_embeddings(self) -> nn.Linear:
        return self.lm_head
