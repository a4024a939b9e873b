"""Each model once, loaded through the workers' registry: transformers runs the target as loaded, this
generator runs the same weights prepared for decoding (`DecodingModel.prepare` copies what it fuses
and leaves the transformers model untouched), and every drafter gets the weights its kind loads."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from jobs.bench.config import BenchConfig, job_config
from workers.engine.generator import eos_ids
from workers.registry import DRAFTERS, Models, load_models


@dataclass
class BenchModels:
    tokenizer: Any
    hf_target: torch.nn.Module
    hf_draft: torch.nn.Module | None   # transformers' assisted generation (model.draft)
    by_drafter: dict[str, Models]      # what each drafter kind is built from ("none" included)
    eos_ids: list[int]
    pad_id: int
    device: torch.device


def _page_in(model: torch.nn.Module | None) -> None:
    """Read every weight once: safetensors weights are memory-mapped and paged in on first use, which would
    otherwise charge the first cell of each model with the whole model in its memory peak."""
    if model is not None:
        with torch.no_grad():
            for parameter in model.parameters():
                parameter.detach().float().sum()


def load_bench_models(cfg: BenchConfig, device: torch.device) -> BenchModels:
    base = load_models(job_config(cfg, "none", 0, 1), device, transformers_model=True)  # transformers is a peer
    by_drafter = {"none": base}
    for name in cfg.drafters:   # like load_models: model.draft holds one set of weights, for the first kind that reads it
        loaders = [DRAFTERS[part].load_draft for part in name.split("+") if DRAFTERS[part].load_draft is not None]
        by_drafter[name] = Models(base.target, base.tokenizer,
                                  loaders[0](job_config(cfg, name, 1, 1), base, device) if loaders else None)
    hf_draft = None
    if cfg.model.draft:
        draft = by_drafter["model"] if "model" in by_drafter else Models(
            base.target, base.tokenizer, DRAFTERS["model"].load_draft(job_config(cfg, "model", 1, 1), base, device))
        hf_draft = draft.draft.model
    hf_target = base.target.model
    for model in (hf_target, hf_draft):
        _page_in(model)
    eos = sorted(eos_ids(hf_target.generation_config, base.tokenizer))
    pad = base.tokenizer.pad_token_id if base.tokenizer.pad_token_id is not None else eos[0]
    return BenchModels(base.tokenizer, hf_target, hf_draft, by_drafter, eos, pad, device)
