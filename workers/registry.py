"""One home for what a config's names mean: the models a job loads, its drafter, its controller, its
generator. Workers and the bench build generators here and nowhere else.

A drafter kind is registered with how to build it and, when it needs weights of its own (`model.draft`),
how to load them next to the target: adding a drafter is one `register_drafter` call.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from workers.config import JobConfig, SpeculationConfig
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.controller import AdaptiveK, Controller, FixedK
from workers.engine.costs import CostModel
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import DEFAULT_PRIOR, Drafter, NoDrafter
from workers.engine.kernel_choice import choose_single_row_kernel, packed_wins, remembered_timings
from workers.engine.generator import GenerationSettings, SpeculativeGenerator
from workers.engine.model_drafter import ModelDrafter
from workers.engine.mtp_drafter import MTPDrafter
from workers.engine.ngram_drafter import NgramDrafter
from workers.engine.sampling import SamplingParams
from workers.engine.suffix_drafter import SuffixDrafter
from workers.model_paths import cache_root
from workers.engine.checkpoint import CheckpointLM
from workers.models import load_model, load_tokenizer

if TYPE_CHECKING:
    from workers.mtp_head import MTPHead


log = logging.getLogger(__name__)


@dataclass
class Models:
    """What a worker holds for the job's lifetime: the target prepared for decoding, its tokenizer, and
    the drafter's own weights when it has any (whatever its kind's loader returns)."""
    target: DecodingModel
    tokenizer: Any
    draft: Any = None
    costs: CostModel = field(default_factory=CostModel)  # measured pass costs: facts of these models on this device,
                                                         # kept by every adaptive generator built over them


@dataclass(frozen=True)
class DrafterKind:
    build: Callable[[Models, SpeculationConfig, SamplingParams], Drafter]
    load_draft: Callable[[JobConfig, Models, torch.device], Any] | None = None  # reads model.draft


DRAFTERS: dict[str, DrafterKind] = {}


def register_drafter(name: str, kind: DrafterKind) -> None:
    DRAFTERS[name] = kind


def _load_draft_model(config: JobConfig, models: Models, device: torch.device) -> DecodingModel:
    m, options = config.model, config.input.storage_options
    # loaded the way the target was: with transformers' modules where the caller asked for them
    draft = load_model(m.draft, m.dtype, device, options, m.trust_remote_code,
                       transformers_model=not isinstance(models.target.model, CheckpointLM))
    if load_tokenizer(m.draft, options, m.trust_remote_code, transformers_tokenizer=False).get_vocab() != models.tokenizer.get_vocab():
        raise ValueError(f"draft model {m.draft} does not share the target's tokenizer ({m.target})")
    return DecodingModel.prepare(draft, compile=m.compile, step=m.step)


def _load_mtp_head(config: JobConfig, models: Models, device: torch.device) -> MTPHead:
    """The head at model.draft, checked against the target (hidden size, vocabulary) before any generation."""
    from workers.mtp_head import load_head  # transformers' Llama modules: only jobs that draft with a head import them

    return load_head(config.model.draft, models.target.model, config.input.storage_options)


register_drafter("none", DrafterKind(lambda models, spec, sampling: NoDrafter()))
register_drafter("ngram", DrafterKind(lambda models, spec, sampling: NgramDrafter(spec.ngram_size)))
register_drafter("model", DrafterKind(lambda models, spec, sampling: ModelDrafter(models.draft, sampling),
                                      _load_draft_model))
register_drafter("suffix", DrafterKind(lambda models, spec, sampling: SuffixDrafter(spec.suffix_max_tokens)))
register_drafter("mtp", DrafterKind(lambda models, spec, sampling: MTPDrafter(models.target, models.draft, sampling),
                                    _load_mtp_head))


def pick_device() -> torch.device:
    return torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")


def load_models(config: JobConfig, device: torch.device, transformers_model: bool = False) -> Models:
    """The target (prepared once for decoding) and the tokenizer, then the drafter's weights if it has any.
    `transformers_model`: transformers' own modules and tokenizer (the bench runs transformers' `generate` on
    them, distill its forward); workers need only the weights and tokenizer.json."""
    m, options = config.model, config.input.storage_options
    source = load_model(m.target, m.dtype, device, options, m.trust_remote_code, transformers_model)
    remembered = cache_root() / "kernel-choice.json"
    known = remembered_timings(source, remembered) if device.type == "cpu" else None
    target = DecodingModel.prepare(source, compile=m.compile, step=m.step, gemv=not (known and packed_wins(known)))
    timings = None
    if device.type == "cpu":
        target, timings = choose_single_row_kernel(target, remembered=remembered)
        log.info("width-1 pass: %s", timings or known)
    models = Models(target, load_tokenizer(m.target, options, m.trust_remote_code, transformers_model),
                    costs=CostModel(floor_s=1e-3 * min(timings.values()) if timings else None))
    loaders = [DRAFTERS[name].load_draft for name in m.drafters if DRAFTERS[name].load_draft is not None]
    if loaders:  # model.draft names one set of weights: at most one drafter kind reads it
        models.draft = loaders[0](config, models, device)
    return models


def make_drafter(name: str | list[str], models: Models, speculation: SpeculationConfig,
                 sampling: SamplingParams) -> Drafter:
    """The drafter a config names; a list composes them in order (see ComposedDrafter)."""
    if isinstance(name, list):
        return ComposedDrafter([make_drafter(part, models, speculation, sampling) for part in name])
    return DRAFTERS[name].build(models, speculation, sampling)


def make_controller(k: int | str, max_k: int, rows: int, costs: CostModel | None = None,
                    prior: tuple[tuple[float, ...], tuple[float, ...]] = DEFAULT_PRIOR) -> Controller:
    """`adaptive` (over the given cost table, else a new one; starting from the drafter's prior) or a fixed k."""
    return AdaptiveK(max_k, rows, costs, prior) if k == "adaptive" else FixedK(int(k))


def sampling_params(config: JobConfig) -> SamplingParams:
    g = config.generation
    return SamplingParams(g.temperature, g.top_k, g.top_p, config.speculation.sampling)


def make_generator(config: JobConfig, models: Models, drafter: Drafter | None = None) -> SpeculativeGenerator:
    """The config's generator; `drafter` replaces the one the config names (a learning job's, after the switch)."""
    g, s = config.generation, config.speculation
    max_k = s.max_k if s.k == "adaptive" else int(s.k)
    settings = GenerationSettings(max_new_tokens=g.max_new_tokens, sampling=sampling_params(config), stop=tuple(g.stop),
                                  batch_size=config.resources.batch_size, max_k=max_k, overlong=config.input.overlong,
                                  logprobs=g.logprobs)
    drafter = drafter or make_drafter(config.model.drafter, models, s, settings.sampling)
    controller = make_controller(s.k, max_k, config.resources.batch_size, models.costs, drafter.acceptance_prior)
    return SpeculativeGenerator(models.target, models.tokenizer, drafter, controller, settings)


def drafter_parts(drafter: Drafter) -> list[Drafter]:
    """The drafters a (possibly composed) drafter drafts with, in order."""
    return list(drafter.drafters) if isinstance(drafter, ComposedDrafter) else [drafter]


def with_learned_head(config: JobConfig, models: Models, drafter: Drafter, files: dict[str, bytes]) -> SpeculativeGenerator:
    """A learning job's generator once its head is learnt: the copy drafters it ran with, their state kept (a
    suffix index keeps what it has read), first when they are confident, and the head for every other row."""
    from workers.mtp_head import head_from_files

    models.draft = head_from_files(files, models.target.model, "the job's learnt head")
    head = make_drafter("mtp", models, config.speculation, sampling_params(config))
    copies = [d for d in drafter_parts(drafter) if d.name != "none"]
    return make_generator(config, models, ComposedDrafter([*copies, head]) if copies else head)


def encode_prompt(tokenizer: Any, prompt: str | None, messages: list[dict] | None, chat_template: bool) -> list[int]:
    """Token ids for a row: its chat messages, or its prompt wrapped as one user turn when the chat template
    is on, or the plain prompt."""
    if messages is None and chat_template:
        messages = [{"role": "user", "content": prompt}]
    if messages is not None:
        return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                  return_dict=True)["input_ids"])
    return list(tokenizer(prompt, add_special_tokens=True)["input_ids"])
