"""One home for what a config's names mean: the models a job loads, its drafter, its controller, its
generator. Workers and the bench build generators here and nowhere else.

A drafter kind is registered with how to build it and, when it needs weights of its own (`model.draft`),
how to load them next to the target: adding a drafter is one `register_drafter` call.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from workers.config import JobConfig, SpeculationConfig
from workers.engine.controller import AdaptiveK, Controller, FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import Drafter, NoDrafter
from workers.engine.generator import GenerationSettings, SpeculativeGenerator
from workers.engine.model_drafter import ModelDrafter
from workers.engine.ngram_drafter import NgramDrafter
from workers.engine.sampling import SamplingParams
from workers.models import load_model, load_tokenizer


@dataclass
class Models:
    """What a worker holds for the job's lifetime: the target prepared for decoding, its tokenizer, and
    the drafter's own weights when it has any (whatever its kind's loader returns)."""
    target: DecodingModel
    tokenizer: Any
    draft: Any = None


@dataclass(frozen=True)
class DrafterKind:
    build: Callable[[Models, SpeculationConfig, SamplingParams], Drafter]
    load_draft: Callable[[JobConfig, Models, torch.device], Any] | None = None  # reads model.draft


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(name: str, kind: DrafterKind) -> None:
    DRAFTERS[name] = kind


def _load_draft_model(config: JobConfig, models: Models, device: torch.device) -> DecodingModel:
    m, options = config.model, config.input.storage_options
    draft = load_model(m.draft, m.dtype, device, options, m.trust_remote_code)
    if load_tokenizer(m.draft, options, m.trust_remote_code).get_vocab() != models.tokenizer.get_vocab():
        raise ValueError(f"draft model {m.draft} does not share the target's tokenizer ({m.target})")
    return DecodingModel.prepare(draft, compile=m.compile)


register_drafter("none", DrafterKind(lambda models, spec, sampling: NoDrafter()))
register_drafter("ngram", DrafterKind(lambda models, spec, sampling: NgramDrafter(spec.ngram_size)))
register_drafter("model", DrafterKind(lambda models, spec, sampling: ModelDrafter(models.draft, sampling),
                                      _load_draft_model))


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_models(config: JobConfig, device: torch.device) -> Models:
    """The target (prepared once for decoding) and the tokenizer, then the drafter's weights if it has any."""
    m, options = config.model, config.input.storage_options
    target = DecodingModel.prepare(load_model(m.target, m.dtype, device, options, m.trust_remote_code), compile=m.compile)
    models = Models(target, load_tokenizer(m.target, options, m.trust_remote_code))
    loader = DRAFTERS[m.drafter].load_draft
    if loader is not None:
        models.draft = loader(config, models, device)
    return models


def make_drafter(name: str, models: Models, speculation: SpeculationConfig, sampling: SamplingParams) -> Drafter:
    return DRAFTERS[name].build(models, speculation, sampling)


def make_controller(k: int | str, max_k: int, rows: int) -> Controller:
    """`adaptive` or a fixed k."""
    return AdaptiveK(max_k, rows) if k == "adaptive" else FixedK(int(k))


def make_generator(config: JobConfig, models: Models) -> SpeculativeGenerator:
    g, s = config.generation, config.speculation
    sampling = SamplingParams(g.temperature, g.top_k, g.top_p)
    max_k = s.max_k if s.k == "adaptive" else int(s.k)
    settings = GenerationSettings(max_new_tokens=g.max_new_tokens, sampling=sampling, stop=tuple(g.stop),
                                  batch_size=config.resources.batch_size, max_k=max_k, overlong=config.input.overlong)
    return SpeculativeGenerator(models.target, models.tokenizer, make_drafter(config.model.drafter, models, s, sampling),
                                make_controller(s.k, max_k, config.resources.batch_size), settings)


def encode_prompt(tokenizer: Any, prompt: str | None, messages: list[dict] | None, chat_template: bool) -> list[int]:
    """Token ids for a row: its chat messages, or its prompt wrapped as one user turn when the chat template
    is on, or the plain prompt."""
    if messages is None and chat_template:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
