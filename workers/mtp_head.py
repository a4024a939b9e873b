"""The MTP draft head: DeepSeek-V3's multi-token prediction module, trained after the fact on a frozen target.

    h'_i = W [RMSNorm(h_i); RMSNorm(E(t_{i+1}))]  ->  decoder block(s)  ->  target's final norm and LM head

h_i is the target's last hidden state as its LM head reads it (after the final norm): the verify pass
computes it anyway, so drafting adds no target work. DeepSeek-V3 and EAGLE feed the state before the final
norm; since the head's own RMSNorm comes first, the two differ by a fixed per-channel scale the head learns.
The head's output goes through the target's final norm too, so it lives in the same space as h and
drafting chains the head on its own output (EAGLE-style): k drafts cost k head passes. The embedding, the
final norm and the LM head are the target's own tensors: shared storage, frozen, never saved. Only W, the
two input norms and the block belong to the head (about 4M parameters for SmolLM2-135M).

An optional reduced draft vocabulary (FR-Spec, EAGLE-3) restricts the draft's LM head to the V' tokens the
target emits most; only their ids are stored. Output stays lossless: the target verifies every draft, and
for sampling the head's q is 0 outside the subset.
"""
from __future__ import annotations

import io
import json
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from safetensors.torch import load as load_safetensors
from safetensors.torch import save as save_safetensors
from transformers import LlamaConfig, PreTrainedModel
from transformers.models.llama.modeling_llama import (
    LlamaDecoderLayer,
    LlamaRMSNorm,
    LlamaRotaryEmbedding,
)

from workers.engine.checkpoint import CheckpointLM
from workers.engine.linear import Linear, linear
from workers.model_paths import HEAD_CONFIG, HEAD_REPORT, HEAD_WEIGHTS, check_head_path, read_head_files
from workers.storage import join, read_bytes, write_bytes_atomic

WEIGHTS, CONFIG, REPORT = HEAD_WEIGHTS, HEAD_CONFIG, HEAD_REPORT
_BLOCK_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "rms_norm_eps", "max_position_embeddings")


class HeadMismatch(ValueError):
    """The head was distilled for a target of another shape; it cannot draft for this one."""


@dataclass(frozen=True)
class HeadSpec:
    """What config.json holds: the target's fingerprint and the head's shape."""
    target: str                 # the target's name or path, as the distill config gave it
    hidden_size: int
    vocab_size: int
    n_layers: int
    draft_vocab: int            # V' (0: the full vocabulary)
    block: dict                 # LlamaConfig fields of the head's decoder block

    @staticmethod
    def for_target(target: PreTrainedModel | CheckpointLM, name: str, n_layers: int = 1, draft_vocab: int = 0) -> HeadSpec:
        """A head shaped like one of the target's own decoder layers."""
        cfg = target.config
        block = {key: getattr(cfg, key) for key in _BLOCK_KEYS if getattr(cfg, key, None) is not None}
        rope = getattr(cfg, "rope_parameters", None) or {"rope_type": "default", "rope_theta": getattr(cfg, "rope_theta", 1e4)}
        block["rope_parameters"] = dict(rope)
        return HeadSpec(name, cfg.hidden_size, target.get_output_embeddings().weight.shape[0], n_layers, draft_vocab, block)


@dataclass(frozen=True)
class SharedTensors:
    """The target's embedding, final norm and LM head: detached views of the target's own storage."""
    embed: torch.Tensor         # (vocab, hidden)
    norm: torch.Tensor          # (hidden,)
    head: torch.Tensor          # (vocab, hidden)
    head_bias: torch.Tensor | None
    eps: float

    @staticmethod
    def of(target: PreTrainedModel | CheckpointLM) -> SharedTensors:
        norm, head = target.get_decoder().norm, target.get_output_embeddings()
        bias = getattr(head, "bias", None)
        return SharedTensors(target.get_input_embeddings().weight.detach(), norm.weight.detach(), head.weight.detach(),
                             None if bias is None else bias.detach(), float(target.config.rms_norm_eps))


def check_target(spec: HeadSpec, target: PreTrainedModel | CheckpointLM, where: str) -> None:
    """Fail before generation, naming both shapes, when the head cannot draft for this target."""
    hidden, vocab = target.config.hidden_size, target.get_output_embeddings().weight.shape[0]
    if (spec.hidden_size, spec.vocab_size) != (hidden, vocab):
        name = getattr(target.config, "_name_or_path", "") or type(target).__name__
        raise HeadMismatch(f"MTP head at {where} was distilled for {spec.target} (hidden size {spec.hidden_size}, "
                           f"vocabulary {spec.vocab_size}); the target {name} has hidden size {hidden}, vocabulary "
                           f"{vocab}: distill a head for this target with `specbatch distill`")


class MTPHead(torch.nn.Module):
    def __init__(self, spec: HeadSpec, target: PreTrainedModel | CheckpointLM):
        super().__init__()
        check_target(spec, target, "(new)")
        self.spec = spec
        self.shared = SharedTensors.of(target)  # a plain attribute: not a parameter, not in the state dict
        d, eps = spec.hidden_size, spec.block["rms_norm_eps"]
        self.hidden_norm, self.token_norm = LlamaRMSNorm(d, eps), LlamaRMSNorm(d, eps)
        self.proj = torch.nn.Linear(2 * d, d, bias=False)
        block = LlamaConfig(**spec.block, hidden_act="silu", attention_bias=False, mlp_bias=False)
        block._attn_implementation = "sdpa"
        self.layers = torch.nn.ModuleList(LlamaDecoderLayer(block, i) for i in range(spec.n_layers))
        self.rotary = LlamaRotaryEmbedding(block)
        if spec.draft_vocab:
            self.register_buffer("vocab_ids", torch.zeros(spec.draft_vocab, dtype=torch.long))
        else:
            self.vocab_ids = None

    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor,
                cache=None) -> torch.Tensor:
        """(n, q, d) target (or chained head) states and the tokens that followed them -> the head's own
        states after the target's final norm, whose logits predict the token after `tokens`.
        `mask` is additive (n, 1, q, kv)."""
        x = self.project(hidden, tokens)
        rotary = self.rotary(x, positions)
        for layer in self.layers:
            x = layer(x, attention_mask=mask, position_ids=positions, cache=cache, use_cache=cache is not None,
                      position_embeddings=rotary)
        return F.rms_norm(x, (x.shape[-1],), self.shared.norm.to(x.dtype), self.shared.eps)

    def project(self, hidden: torch.Tensor, tokens: torch.Tensor, proj: Linear | None = None) -> torch.Tensor:
        """The block's input: W [RMSNorm(h); RMSNorm(E(t))] for states (n, q, d) and the tokens after them (n, q);
        `proj`: W laid out for drafting (mtp_drafter.DraftHead), else the module itself."""
        embedded = F.embedding(tokens, self.shared.embed).to(self.proj.weight.dtype)
        x = torch.cat([self.hidden_norm(hidden.to(self.proj.weight.dtype)), self.token_norm(embedded)], -1)
        return self.proj(x) if proj is None else linear(x, proj)

    def head_rows(self) -> torch.Tensor:
        """The LM head rows the draft scores, (V', d): the shared head itself, or a gather of its subset rows."""
        return self.shared.head if self.vocab_ids is None else self.shared.head[self.vocab_ids]

    def logits(self, states: torch.Tensor, rows_t: torch.Tensor | None = None) -> torch.Tensor:
        """fp32 logits over the draft vocabulary (V' entries; index i is token vocab_ids[i]) of head or target
        states, with autograd (training; drafting uses mtp_drafter.DraftHead); rows_t is head_rows().t(), passed
        in by callers that keep one."""
        rows_t = self.head_rows().t() if rows_t is None else rows_t
        out = states @ rows_t.to(states.dtype)
        if self.shared.head_bias is not None:
            bias = self.shared.head_bias
            out = out + (bias if self.vocab_ids is None else bias[self.vocab_ids])
        return out.float()

    def to_full_vocab(self, draft_index: torch.Tensor) -> torch.Tensor:
        """Token ids of draft-vocabulary indices."""
        return draft_index if self.vocab_ids is None else self.vocab_ids[draft_index]


def head_parameters(head: MTPHead) -> int:
    return sum(p.numel() for p in head.parameters())


def save_head(head: MTPHead, url: str, report: dict, storage_options: dict | None = None) -> None:
    """Head-only weights (safetensors), config.json and report.json; config.json goes last, so a folder with
    one is complete."""
    weights = {name: t.detach().float().contiguous() if t.is_floating_point() else t.contiguous()
               for name, t in head.state_dict().items()}
    write_bytes_atomic(join(url, WEIGHTS), save_safetensors(weights), storage_options)
    write_bytes_atomic(join(url, REPORT), json.dumps(report, indent=2).encode(), storage_options)
    write_bytes_atomic(join(url, CONFIG), json.dumps(asdict(head.spec), indent=2).encode(), storage_options)


def read_spec(url: str, storage_options: dict | None = None) -> HeadSpec:
    check_head_path(url, storage_options)
    return HeadSpec(**json.loads(read_bytes(join(url, CONFIG), storage_options)))


def load_head(url: str, target: PreTrainedModel | CheckpointLM, storage_options: dict | None = None) -> MTPHead:
    """The head at a local or object-storage folder, on the target's device and dtype, frozen and in eval mode."""
    return head_from_files(read_head_files(url, storage_options), target, url)


def head_from_files(files: dict[str, bytes], target: PreTrainedModel | CheckpointLM, where: str) -> MTPHead:
    """A head from its folder's files (read_head_files), ready to draft for the target."""
    spec = HeadSpec(**json.loads(files[CONFIG]))
    check_target(spec, target, where)
    head = MTPHead(spec, target)
    head.load_state_dict(load_safetensors(files[WEIGHTS]), strict=True)
    param = target.get_output_embeddings().weight
    head.to(param.device)
    for module in (head.hidden_norm, head.token_norm, head.proj, head.layers):
        module.to(param.dtype)  # not the rotary buffers: RoPE frequencies stay fp32
    return head.requires_grad_(False).eval()


def read_report(url: str, storage_options: dict | None = None) -> dict:
    return json.load(io.BytesIO(read_bytes(join(url, REPORT), storage_options)))
