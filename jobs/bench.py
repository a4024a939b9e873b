"""`specbatch bench`: this generator side by side with transformers, on one model, one prompt set, one machine.

Why it is built the way it is:
- Same inputs for everyone: the prompts are encoded once (chat template), every system decodes
  greedily with the same EOS set, the same `max_new_tokens` and the same torch thread count.
- transformers runs the very model this generator decodes with: preparing a model for decoding
  (`DecodingModel.prepare`) copies what it fuses and leaves the transformers model untouched.
- Speed only counts when the output is right: every output is compared token for token with
  transformers' greedy `generate` at batch size 1 on the same prompt (`matches_greedy`).
- Each (system, batch size) gets one short untimed warm-up before its timed cells; each timed
  repeat builds a fresh generator (a fresh adaptive controller), so repeats measure the same thing.
- Peak memory per cell: on CUDA `torch.cuda.max_memory_allocated` after a reset; on Linux the
  process RSS high-water mark (VmHWM) reset through /proc/self/clear_refs before the cell; elsewhere
  getrusage's maxrss (process lifetime, so only growth shows). The `mem_method` column says which.
  RSS includes every model copy the bench holds, so compare cells with each other, not with a
  deployment.
- The pipeline row runs a whole job through Ray (planning, reading, writing, actor start-up and
  model load included) against ShardRunner alone on the same rows, to show what the pipeline costs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import re
import resource
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator
from typing_extensions import Self

from workers.config import JobConfig, SpeculationConfig
from workers.engine.decoding_model import DecodingModel
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator, eos_ids
from workers.engine.sampling import SamplingParams
from workers.models import DEMO_MODEL, load_model, load_tokenizer
from workers.mtp_head import MTPHead, load_head
from workers.registry import Models, encode_prompt, make_controller, make_drafter

REPO_ROOT = Path(__file__).resolve().parents[1]
TRANSFORMERS = "transformers"
SPECBATCH = "specbatch"


class BenchError(ValueError):
    """The benchmark cannot run as configured; the message says why and what to do."""


# ----------------------------------------------------------------------------------------- config

class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BenchModelConfig(_Strict):
    target: str = DEMO_MODEL
    draft: str | None = None
    mtp_head: str | None = None     # an MTP head folder from `specbatch distill` for this target (the mtp drafter)
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"


class PipelineBenchConfig(_Strict):
    enabled: bool = True
    workload: str = "mix"
    copies: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1)
    k: int | Literal["adaptive"] = "adaptive"
    rows_per_shard: int = Field(16, ge=1)


class BenchConfig(_Strict):
    """What `specbatch bench` runs; configs/bench.yaml documents every key."""
    model: BenchModelConfig = Field(default_factory=BenchModelConfig)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    prompts: str = "configs/data/bench_prompts.jsonl"
    workloads: list[str] = Field(default_factory=lambda: ["rewriting", "extraction", "code", "open", "mix"], min_length=1)
    prompts_per_workload: int | None = Field(None, ge=1)
    min_rows_per_workload: int | None = Field(None, ge=1)   # cycle prompts up to this many rows (fills big batches)
    max_rows_by_batch: dict[int, int] = Field(default_factory=dict)  # batch size -> rows its cells run (the first N)
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16], min_length=1)
    ks: list[int] = Field(default_factory=lambda: [0, 1, 2, 4, 8])
    adaptive: bool = True
    max_k: int = Field(8, ge=1, le=64)
    drafters: list[Literal["ngram", "model", "mtp"]] = Field(default_factory=lambda: ["ngram"], min_length=1)
    ngram_size: int = Field(3, ge=1)
    max_new_tokens: int = Field(128, ge=1)
    repeats: int = Field(3, ge=1)
    warmup_tokens: int = Field(8, ge=1)
    prompt_lookup_num_tokens: int = Field(10, ge=1)
    assistant_schedules: list[Literal["heuristic", "heuristic_transient", "constant"]] = Field(
        default_factory=lambda: ["heuristic", "constant"])
    pipeline: PipelineBenchConfig = Field(default_factory=PipelineBenchConfig)

    @model_validator(mode="after")
    def _consistent(self) -> BenchConfig:
        if any(k < 0 or k > self.max_k for k in self.ks):
            raise ValueError(f"ks must lie in 0..max_k ({self.max_k}), got {self.ks}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch_sizes must be >= 1")
        if "model" in self.drafters and not self.model.draft:
            raise ValueError("drafters lists 'model' but model.draft is not set")
        if "mtp" in self.drafters and not self.model.mtp_head:
            raise ValueError("drafters lists 'mtp' but model.mtp_head is not set")
        if self.pipeline.enabled and self.pipeline.workload not in self.workloads:
            raise ValueError(f"pipeline.workload {self.pipeline.workload!r} is not among workloads {self.workloads}")
        return self


def _merge(base: dict, over: dict) -> dict:
    """Deep-merge `over` into a copy of `base` (sections merge, other values replace)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def load_bench_config(source: str | Path | dict, quick: bool = False) -> BenchConfig:
    """A BenchConfig from a YAML file or a dict; `quick` applies the `quick:` section on top."""
    if isinstance(source, dict):
        data = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise BenchError(f"{source}: no such bench config")
        data = yaml.safe_load(path.read_text()) or {}
    quick_section = data.pop("quick", None) or {}
    if quick:
        data = _merge(data, quick_section)
    try:
        return BenchConfig.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or '(config)'}: {e['msg']}" for e in exc.errors())
        raise BenchError(f"invalid bench config: {problems}") from None


def resolve_device(name: str) -> torch.device:
    """The configured device; `cuda` without a usable GPU is refused rather than silently run on the CPU."""
    if name == "cuda" and not torch.cuda.is_available():
        raise BenchError(f"the bench config says device: cuda but torch sees no CUDA device (torch {torch.__version__}, "
                         f"CUDA build {torch.version.cuda or 'none'}); run it on a GPU machine, or use "
                         "configs/bench.yaml (device: cpu)")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def _resolve_path(path: str) -> Path:
    """A relative prompt path is looked up in the working directory first, then in the repository."""
    candidate = Path(path).expanduser()
    if candidate.is_absolute() or candidate.exists():
        return candidate
    return REPO_ROOT / candidate


# ---------------------------------------------------------------------------------------- prompts

@dataclass(frozen=True)
class Prompt:
    id: str
    workload: str
    text: str
    ids: tuple[int, ...]


def encode(tokenizer: Any, text: str) -> list[int]:
    """What a worker does with a prompt column: the chat template when the tokenizer has one."""
    return encode_prompt(tokenizer, text, None, bool(getattr(tokenizer, "chat_template", None)))


def _interleave(groups: list[list[Prompt]]) -> list[Prompt]:
    """Round-robin over the groups: the mix alternates workloads instead of running them back to back."""
    out = []
    for i in range(max((len(g) for g in groups), default=0)):
        out += [g[i] for g in groups if i < len(g)]
    return out


def _cycle(prompts: list[Prompt], rows: int) -> list[Prompt]:
    """The first `rows` of the prompts repeated (with distinct ids): fills large batches from a small prompt set."""
    out = list(prompts[:rows])
    for i in range(len(out), rows if prompts else 0):
        source = prompts[i % len(prompts)]
        out.append(replace(source, id=f"{source.id}#{i // len(prompts)}"))
    return out


def build_workloads(cfg: BenchConfig, tokenizer: Any) -> dict[str, list[Prompt]]:
    """workload -> prompts, in the config's order; `mix` interleaves the other named workloads."""
    path = _resolve_path(cfg.prompts)
    if not path.is_file():
        raise BenchError(f"prompt file {cfg.prompts} not found")
    by_workload: dict[str, list[Prompt]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            row = json.loads(line)
            by_workload.setdefault(row["workload"], []).append(
                Prompt(str(row["id"]), row["workload"], row["prompt"], tuple(encode(tokenizer, row["prompt"]))))
    by_workload = {w: p[: cfg.prompts_per_workload] for w, p in by_workload.items()}
    named = [w for w in cfg.workloads if w != "mix"]
    missing = [w for w in named if w not in by_workload]
    if missing:
        raise BenchError(f"workloads {missing} have no prompts in {cfg.prompts} (it has {sorted(by_workload)})")
    workloads = {}
    for name in cfg.workloads:
        prompts = _interleave([by_workload[w] for w in (named or list(by_workload))]) if name == "mix" else by_workload[name]
        workloads[name] = _cycle(prompts, max(cfg.min_rows_per_workload or 0, len(prompts)))
    return workloads


# ----------------------------------------------------------------------------------------- models

@dataclass
class BenchModels:
    """Each model once: transformers runs it as loaded, this generator runs it prepared for decoding."""
    tokenizer: Any
    hf_target: torch.nn.Module
    our_target: DecodingModel
    hf_draft: torch.nn.Module | None
    our_draft: DecodingModel | None
    mtp_head: MTPHead | None
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
    """Load each model once and prepare it for this generator."""
    m = cfg.model
    tokenizer = load_tokenizer(m.target)
    hf_target = load_model(m.target, m.dtype, device)
    hf_draft = load_model(m.draft, m.dtype, device) if m.draft else None
    for model in (hf_target, hf_draft):
        _page_in(model)
    our_draft = DecodingModel.prepare(hf_draft) if hf_draft is not None and "model" in cfg.drafters else None
    head = load_head(m.mtp_head, hf_target) if "mtp" in cfg.drafters else None
    eos = sorted(eos_ids(hf_target.generation_config, tokenizer))
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    return BenchModels(tokenizer, hf_target, DecodingModel.prepare(hf_target), hf_draft, our_draft, head, eos, pad,
                       device)


# ---------------------------------------------------------------------------------------- systems

@dataclass(frozen=True)
class System:
    name: str
    family: str                 # transformers | specbatch
    drafter: str                # none | prompt-lookup | model | ngram
    k: int | None               # fixed draft length; None: adaptive, or transformers' assistant schedule
    schedule: str | None = None  # transformers' num_assistant_tokens_schedule, or "adaptive" for ours
    batch1_only: bool = False   # transformers' assisted generation refuses batch_size > 1


def bench_systems(cfg: BenchConfig) -> list[System]:
    """Every system the config asks for, baselines first."""
    n = cfg.prompt_lookup_num_tokens
    out = [System(TRANSFORMERS, TRANSFORMERS, "none", 0),
           System(f"transformers prompt-lookup {n}", TRANSFORMERS, "prompt-lookup", n, None, True)]
    if cfg.model.draft:
        out += [System(f"transformers draft {s}", TRANSFORMERS, "model", None, s, True) for s in cfg.assistant_schedules]
    for k in sorted(set(cfg.ks)):
        if k == 0:
            out.append(System("specbatch k=0", SPECBATCH, "none", 0))
        else:
            out += [System(f"specbatch {d} k={k}", SPECBATCH, d, k) for d in cfg.drafters]
    if cfg.adaptive:
        out += [System(f"specbatch {d} adaptive", SPECBATCH, d, None, "adaptive") for d in cfg.drafters]
    return out


@dataclass
class Run:
    """One timed pass of a system over a cell's prompts."""
    outputs: list[list[int]]
    wall_s: float
    target_passes: int
    row_passes: int              # sum over target passes of the rows in each pass
    accept_by_position: list[float]
    k_hist: list[int]

    @property
    def generated(self) -> int:
        return sum(len(o) for o in self.outputs)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """A completion up to and including its first EOS (transformers pads finished rows after it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


class PassCounter:
    """Counts a transformers model's forward calls (one call = one target pass) and the rows in each.
    A hook on the target alone: an assistant model is a separate module and is not counted."""

    def __init__(self, model: torch.nn.Module):
        self.model, self.passes, self.rows = model, 0, 0

    def _hook(self, module: torch.nn.Module, args: tuple, output: Any) -> None:
        self.passes += 1
        self.rows += int(output.logits.shape[0])

    def __enter__(self) -> Self:
        self.handle = self.model.register_forward_hook(self._hook)
        return self

    def __exit__(self, *exc: object) -> None:
        self.handle.remove()


def hf_generate(model: torch.nn.Module, batch: list[tuple[int, ...]], models: BenchModels, max_new_tokens: int,
                **extra: Any) -> list[list[int]]:
    """transformers' own greedy `generate` on a left-padded batch; completions cut at EOS."""
    width = max(len(p) for p in batch)
    ids = torch.tensor([[models.pad_id] * (width - len(p)) + list(p) for p in batch], device=models.device)
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in batch], device=models.device)
    out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=max_new_tokens, do_sample=False,
                         eos_token_id=models.eos_ids, pad_token_id=models.pad_id, **extra)
    return [cut_at_eos(row, models.eos_ids) for row in out[:, width:].tolist()]


def run_transformers(system: System, models: BenchModels, prompts: list[Prompt], batch_size: int,
                     max_new_tokens: int, cfg: BenchConfig) -> Run:
    """transformers in chunks of `batch_size`, prompts sorted by length (less padding: the same favour
    this generator's length-sorted admission gets)."""
    extra: dict[str, Any] = {}
    if system.drafter == "prompt-lookup":
        extra["prompt_lookup_num_tokens"] = system.k
    elif system.drafter == "model":
        config = models.hf_draft.generation_config
        config.num_assistant_tokens_schedule = system.schedule
        config.num_assistant_tokens = None  # the heuristic persists across calls; every run starts from the default
        extra["assistant_model"] = models.hf_draft
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    outputs: list[list[int]] = [[] for _ in prompts]
    with PassCounter(models.hf_target) as counter:
        _sync(models.device)
        started = time.perf_counter()
        for at in range(0, len(order), batch_size):
            chunk = order[at : at + batch_size]
            done = hf_generate(models.hf_target, [prompts[i].ids for i in chunk], models, max_new_tokens, **extra)
            for i, tokens in zip(chunk, done):
                outputs[i] = tokens
        _sync(models.device)
        wall = time.perf_counter() - started
    return Run(outputs, wall, counter.passes, counter.rows, [], [])


def our_models(models: BenchModels, drafter: str) -> Models:
    """What a worker running this drafter would hold: the prepared target and the drafter's own weights."""
    return Models(models.our_target, models.tokenizer, models.mtp_head if drafter == "mtp" else models.our_draft)


def make_generator(system: System, models: BenchModels, cfg: BenchConfig, batch_size: int,
                   max_new_tokens: int) -> SpeculativeGenerator:
    """This generator as a worker would build it for the system (shard_runner.make_generator's choices)."""
    k = "adaptive" if system.schedule == "adaptive" else int(system.k)
    max_k = cfg.max_k if k == "adaptive" else k
    speculation = SpeculationConfig(k=k, max_k=max_k, ngram_size=cfg.ngram_size)
    drafter = make_drafter(system.drafter, our_models(models, system.drafter), speculation, SamplingParams())
    settings = GenerationSettings(max_new_tokens=max_new_tokens, batch_size=batch_size, max_k=max_k)
    return SpeculativeGenerator(models.our_target, models.tokenizer, drafter, make_controller(k, max_k, batch_size),
                                settings)


def run_specbatch(system: System, models: BenchModels, prompts: list[Prompt], batch_size: int,
                  max_new_tokens: int, cfg: BenchConfig) -> Run:
    """This generator over all the cell's prompts at once: it keeps `batch_size` rows live and admits
    waiting prompts as rows finish, as a worker does with a shard."""
    generator = make_generator(system, models, cfg, batch_size, max_new_tokens)
    requests = [Request(p.id, list(p.ids), seed=0) for p in prompts]
    _sync(models.device)
    started = time.perf_counter()
    result = generator.generate(requests)
    _sync(models.device)
    wall = time.perf_counter() - started
    errors = [c.error for c in result.completions if c.error]
    if errors:
        raise BenchError(f"{system.name} failed on {len(errors)} prompts: {errors[0]}")
    s = result.stats
    return Run([c.token_ids for c in result.completions], wall, s.target_passes, s.row_passes,
               [float(a) for a in s.accept_by_position], [int(c) for c in s.k_hist])


RUNNERS: dict[str, Callable[..., Run]] = {TRANSFORMERS: run_transformers, SPECBATCH: run_specbatch}


# ----------------------------------------------------------------------------------- measurement

class PeakMemory:
    """Peak memory of one cell, by the best method this machine offers (named in `method`)."""

    def __init__(self, device: torch.device):
        self.device, self.baseline = device, 0.0
        if device.type == "cuda":
            self.method = "cuda max_memory_allocated"
        elif self._clear_refs():
            self.method = "process RSS high-water (VmHWM, reset per cell)"
        else:
            self.method = "process ru_maxrss (lifetime)"

    @staticmethod
    def _clear_refs() -> bool:
        try:
            Path("/proc/self/clear_refs").write_text("5")  # Linux: resets VmHWM to the current RSS
            return True
        except OSError:
            return False

    def reset(self) -> None:
        """Start a cell: forget the old peak and remember what was in use already (for peak_delta_mb)."""
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        elif self.method.startswith("process RSS"):
            self._clear_refs()
        self.baseline = self.current_mb()

    def current_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.memory_allocated() / 2**20
        status = Path("/proc/self/status")
        match = re.search(r"VmRSS:\s+(\d+) kB", status.read_text()) if status.exists() else None
        return int(match.group(1)) / 1024 if match else 0.0

    def delta_mb(self) -> float:
        """The cell's own working memory: its peak over what was in use when it started."""
        return max(0.0, self.peak_mb() - self.baseline)

    def peak_mb(self) -> float:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated() / 2**20
        if self.method.startswith("process RSS"):
            match = re.search(r"VmHWM:\s+(\d+) kB", Path("/proc/self/status").read_text())
            if match:
                return int(match.group(1)) / 1024
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # kB on Linux


def greedy_references(models: BenchModels, workloads: dict[str, list[Prompt]], max_new_tokens: int,
                      log: Callable[[str], None]) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy `generate` at batch 1, once per distinct prompt: the oracle every output must equal."""
    references: dict[tuple[int, ...], list[int]] = {}
    distinct = list(dict.fromkeys(p.ids for prompts in workloads.values() for p in prompts))
    log(f"greedy references: {len(distinct)} prompts x {max_new_tokens} tokens with transformers at batch 1")
    for ids in distinct:
        references[ids] = hf_generate(models.hf_target, [ids], models, max_new_tokens)[0]
    return references


def warm_up(system: System, models: BenchModels, prompts: list[Prompt], batch_size: int, cfg: BenchConfig) -> None:
    """One short untimed generation, the same for every system: first-call costs stay out of the timings."""
    RUNNERS[system.family](system, models, prompts[:batch_size], batch_size, cfg.warmup_tokens, cfg)


def summarize_cell(system: System, runs: list[Run], peaks: list[tuple[float, float]], prompts: list[Prompt], batch_size: int,
                   workload: str, references: dict[tuple[int, ...], list[int]], memory: PeakMemory) -> dict:
    """One result row from a cell's repeats: median tokens/s with min and max; counters from the median run."""
    rates = [r.generated / r.wall_s if r.wall_s else 0.0 for r in runs]
    run = runs[sorted(zip(rates, range(len(runs))))[len(runs) // 2][1]]
    matching = [all(o == references[p.ids] for o, p in zip(r.outputs, prompts)) for r in runs]
    return {
        "section": "generation", "workload": workload, "batch_size": batch_size, "system": system.name,
        "family": system.family, "drafter": system.drafter, "k": system.k,
        "schedule": system.schedule, "rows": len(prompts), "repeats": len(runs),
        "tokens_per_s": statistics.median(rates), "tokens_per_s_min": min(rates), "tokens_per_s_max": max(rates),
        "generated_tokens": run.generated, "wall_s": run.wall_s, "target_passes": run.target_passes,
        "row_passes": run.row_passes,
        "tokens_per_pass": run.generated / run.target_passes if run.target_passes else None,
        "tokens_per_row_pass": run.generated / run.row_passes if run.row_passes else None,
        "accept_by_position": run.accept_by_position, "k_hist": run.k_hist,
        "peak_mem_mb": max(p for p, _ in peaks), "peak_delta_mb": max(d for _, d in peaks), "mem_method": memory.method,
        "matches_greedy": all(matching),
        "rows_matching": sum(o == references[p.ids] for o, p in zip(run.outputs, prompts)),
        "ratio_vs_transformers": None,
    }


def rows_for_batch(prompts: list[Prompt], batch_size: int, cfg: BenchConfig) -> list[Prompt]:
    """The rows a cell at this batch size runs: small batches need fewer rows for a steady measurement."""
    return prompts[: cfg.max_rows_by_batch.get(batch_size, len(prompts))]


def run_cells(cfg: BenchConfig, models: BenchModels, workloads: dict[str, list[Prompt]],
              references: dict[tuple[int, ...], list[int]], log: Callable[[str], None]) -> list[dict]:
    """Every (batch size, system, workload) cell. Each (system, batch size) warms up once first. Repeats are
    interleaved: round r runs every system once (in an order rotated by r) before round r + 1, so a burst of
    load on a shared machine hits all systems of a workload alike instead of one system's repeats."""
    memory, results = PeakMemory(models.device), []
    first = next(iter(workloads.values()))
    for batch_size in cfg.batch_sizes:
        systems = [s for s in bench_systems(cfg) if batch_size == 1 or not s.batch1_only]
        for system in systems:
            warm_up(system, models, first, batch_size, cfg)
        for workload, all_prompts in workloads.items():
            prompts = rows_for_batch(all_prompts, batch_size, cfg)
            runs: dict[str, list[Run]] = {s.name: [] for s in systems}
            peaks: dict[str, list[tuple[float, float]]] = {s.name: [] for s in systems}
            for round_ in range(cfg.repeats):
                shift = round_ % len(systems)
                for system in systems[shift:] + systems[:shift]:
                    memory.reset()
                    runs[system.name].append(
                        RUNNERS[system.family](system, models, prompts, batch_size, cfg.max_new_tokens, cfg))
                    peaks[system.name].append((memory.peak_mb(), memory.delta_mb()))
            for system in systems:
                cell = summarize_cell(system, runs[system.name], peaks[system.name], prompts, batch_size, workload,
                                      references, memory)
                results.append(cell)
                log(f"  b={batch_size:<3} {workload:<10} {system.name:<32} {cell['tokens_per_s']:7.1f} tok/s"
                    f"  {cell['tokens_per_row_pass'] or 0:.2f} tok/row-pass  greedy={cell['matches_greedy']}")
    add_ratios(results)
    return results


def add_ratios(results: list[dict]) -> None:
    """tokens/s over transformers' plain `generate` at the same batch size and workload."""
    base = {(r["workload"], r["batch_size"]): r["tokens_per_s"] for r in results if r["system"] == TRANSFORMERS}
    for r in results:
        b = base.get((r["workload"], r["batch_size"]))
        r["ratio_vs_transformers"] = r["tokens_per_s"] / b if b else None


# --------------------------------------------------------------------------------------- pipeline

def pipeline_job(cfg: BenchConfig, input_path: Path, output_path: Path, device: torch.device,
                 chat_template: bool) -> JobConfig:
    """The job a user would write for these rows, with this bench's model and generation settings."""
    p, drafter = cfg.pipeline, cfg.drafters[0]
    return JobConfig.model_validate({
        "name": "bench-pipeline",
        "input": {"path": str(input_path), "prompt_column": "prompt", "id_column": "id"},
        "output": {"path": str(output_path)},
        "model": {"target": cfg.model.target, "dtype": cfg.model.dtype, "drafter": drafter,
                  **({"draft": {"model": cfg.model.draft, "mtp": cfg.model.mtp_head}[drafter]}
                     if drafter in ("model", "mtp") else {})},
        "generation": {"max_new_tokens": cfg.max_new_tokens, "temperature": 0.0, "chat_template": chat_template},
        "speculation": {"k": p.k, "max_k": cfg.max_k, "ngram_size": cfg.ngram_size},
        "resources": {"workers": 1, "cpus_per_worker": float(os.cpu_count() or 1),
                      "gpus_per_worker": 1.0 if device.type == "cuda" else 0.0, "batch_size": p.batch_size},
        "sharding": {"rows_per_shard": p.rows_per_shard},
    })


def _output_matches(output_path: Path, by_id: dict[str, Prompt], references: dict[tuple[int, ...], list[int]]) -> tuple[int, int]:
    """(rows equal to the greedy reference, rows) in a job's output folder."""
    rows = [r for f in sorted((output_path / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    good = sum(list(r["completion_token_ids"] or []) == references[by_id[r["id"]].ids] for r in rows)
    return good, len(rows)


def run_pipeline(cfg: BenchConfig, models: BenchModels, workloads: dict[str, list[Prompt]],
                 references: dict[tuple[int, ...], list[int]], log: Callable[[str], None]) -> list[dict]:
    """The same rows through ShardRunner alone (models already loaded) and through run_job on local Ray
    (planning, actor start, model load, reading and writing included); two result rows."""
    import ray

    from pipeline.driver import run_job
    from pipeline.planner import plan_shards
    from workers.shard_runner import ShardRunner

    p = cfg.pipeline
    by_id = {f"{pr.id}~{c}": pr for c in range(p.copies) for pr in workloads[p.workload]}
    chat = bool(getattr(models.tokenizer, "chat_template", None))
    with tempfile.TemporaryDirectory(prefix="specbatch-bench-") as tmp:
        input_path = Path(tmp) / "prompts.jsonl"
        input_path.write_text("".join(json.dumps({"id": i, "prompt": pr.text}) + "\n" for i, pr in by_id.items()))
        log(f"pipeline: {len(by_id)} rows of {p.workload}, batch {p.batch_size}, k={p.k}: ShardRunner alone")
        direct_cfg = pipeline_job(cfg, input_path, Path(tmp) / "direct", models.device, chat)
        runner = ShardRunner(direct_cfg, "bench-direct", our_models(models, cfg.drafters[0]))
        started = time.perf_counter()
        direct_stats = [runner.run(spec) for spec in plan_shards(direct_cfg).shards]
        direct_wall = time.perf_counter() - started
        direct_good = _output_matches(Path(tmp) / "direct", by_id, references)

        log("pipeline: the same job through run_job on local Ray")
        ray_cfg = pipeline_job(cfg, input_path, Path(tmp) / "ray", models.device, chat)
        ours = not ray.is_initialized()  # stop only a Ray that run_job starts here
        try:
            summary = run_job(ray_cfg, overwrite=True, progress=False)
        finally:
            if ours and ray.is_initialized():
                ray.shutdown()
        shard_stats = pq.read_table(Path(tmp) / "ray" / "stats" / "shards.parquet").to_pylist()
        ray_good = _output_matches(Path(tmp) / "ray", by_id, references)

    direct_tokens = sum(s["generated_tokens"] for s in direct_stats)
    direct_rate = direct_tokens / direct_wall
    in_shards = sum(s["wall_s"] for s in shard_stats)
    common = {"section": "pipeline", "workload": p.workload, "batch_size": p.batch_size, "family": SPECBATCH,
              "drafter": cfg.drafters[0], "k": None if p.k == "adaptive" else p.k,
              "schedule": "adaptive" if p.k == "adaptive" else None, "rows": len(by_id), "repeats": 1}
    direct_row = {**common, "system": "ShardRunner alone", "tokens_per_s": direct_rate, "generated_tokens": direct_tokens,
                  "wall_s": direct_wall, "matches_greedy": direct_good[0] == direct_good[1] == len(by_id),
                  "rows_matching": direct_good[0], "ratio_vs_direct": 1.0}
    ray_row = {**common, "system": "specbatch job on Ray (run_job)", "tokens_per_s": summary["tokens_per_s"],
               "generated_tokens": summary["generated_tokens"], "wall_s": summary["wall_s"],
               "steady_tokens_per_s": summary["generated_tokens"] / in_shards if in_shards else None,
               "startup_s": summary["wall_s"] - in_shards,
               "matches_greedy": ray_good[0] == ray_good[1] == len(by_id), "rows_matching": ray_good[0],
               "ratio_vs_direct": summary["tokens_per_s"] / direct_rate if direct_rate else None}
    ray_row["steady_ratio_vs_direct"] = (ray_row["steady_tokens_per_s"] or 0) / direct_rate if direct_rate else None
    log(f"pipeline: Ray {ray_row['tokens_per_s']:.1f} tok/s end to end ({ray_row['startup_s']:.1f} s outside shards), "
        f"ShardRunner alone {direct_rate:.1f} tok/s: ratio {ray_row['ratio_vs_direct']:.2f}")
    return [ray_row, direct_row]


# ---------------------------------------------------------------------------------------- outputs

COLUMNS = ["section", "workload", "batch_size", "system", "family", "drafter", "k", "schedule", "rows", "repeats",
           "tokens_per_s", "tokens_per_s_min", "tokens_per_s_max", "ratio_vs_transformers", "generated_tokens",
           "wall_s", "target_passes", "row_passes", "tokens_per_pass", "tokens_per_row_pass", "accept_by_position",
           "k_hist", "peak_mem_mb", "peak_delta_mb", "mem_method", "matches_greedy", "rows_matching", "ratio_vs_direct",
           "steady_tokens_per_s", "steady_ratio_vs_direct", "startup_s"]
_SCHEMA = pa.schema([
    ("section", pa.string()), ("workload", pa.string()), ("batch_size", pa.int64()), ("system", pa.string()),
    ("family", pa.string()), ("drafter", pa.string()), ("k", pa.int64()), ("schedule", pa.string()),
    ("rows", pa.int64()), ("repeats", pa.int64()), ("tokens_per_s", pa.float64()), ("tokens_per_s_min", pa.float64()),
    ("tokens_per_s_max", pa.float64()), ("ratio_vs_transformers", pa.float64()), ("generated_tokens", pa.int64()),
    ("wall_s", pa.float64()), ("target_passes", pa.int64()), ("row_passes", pa.int64()),
    ("tokens_per_pass", pa.float64()), ("tokens_per_row_pass", pa.float64()),
    ("accept_by_position", pa.list_(pa.float64())), ("k_hist", pa.list_(pa.int64())), ("peak_mem_mb", pa.float64()),
    ("peak_delta_mb", pa.float64()), ("mem_method", pa.string()), ("matches_greedy", pa.bool_()), ("rows_matching", pa.int64()),
    ("ratio_vs_direct", pa.float64()), ("steady_tokens_per_s", pa.float64()), ("steady_ratio_vs_direct", pa.float64()),
    ("startup_s", pa.float64()),
])


def machine_info(cfg: BenchConfig, device: torch.device, command: str, quick: bool) -> dict:
    import transformers

    return {
        "command": command, "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "platform": platform.platform(), "machine": platform.machine(), "cpu_count": os.cpu_count(),
        "torch": torch.__version__, "transformers": transformers.__version__, "threads": torch.get_num_threads(),
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "model": cfg.model.target, "draft": cfg.model.draft, "dtype": cfg.model.dtype,
        "max_new_tokens": cfg.max_new_tokens, "repeats": cfg.repeats, "quick": quick,
        "load_at_start": _load_average(),
    }


def _load_average() -> float | None:
    """The 1-minute load average: other work on a shared machine shows up here, and in the timings."""
    try:
        return round(os.getloadavg()[0], 2)
    except OSError:
        return None


def _f(value: float | None, digits: int = 1) -> str:
    return "–" if value is None or math.isnan(value) else f"{value:.{digits}f}"


def _mean_k(k_hist: list[int]) -> str:
    total = sum(k_hist)
    return "–" if not total else f"{sum(k * c for k, c in enumerate(k_hist)) / total:.1f}"


def _alphas(alpha: list[float], shown: int = 4) -> str:
    if not alpha:
        return "–"
    text = " ".join(_f(a, 2) for a in alpha[:shown])
    return text + (" …" if len(alpha) > shown else "")


def _greedy(row: dict) -> str:
    return "yes" if row["matches_greedy"] else f"NO ({row['rows_matching']}/{row['rows']})"


def goal_rows(results: list[dict], cfg: BenchConfig) -> list[tuple[str, str, float | None, str, bool | None]]:
    """The speed goals of issues 3 and 4, checked against this run: (issue, check, value, target, met)."""
    gen = [r for r in results if r["section"] == "generation"]
    rate = {(r["workload"], r["batch_size"], r["system"]): r["tokens_per_s"] for r in gen}
    adaptive = f"specbatch {cfg.drafters[0]} adaptive"
    fixed = ["specbatch k=0"] + [f"specbatch {cfg.drafters[0]} k={k}" for k in sorted(set(cfg.ks)) if k]

    def ratio(w: str, b: int, num: str, den: str) -> float | None:
        a, d = rate.get((w, b, num)), rate.get((w, b, den))
        return a / d if a is not None and d else None

    lookup = f"transformers prompt-lookup {cfg.prompt_lookup_num_tokens}"
    out = [("3", "rewriting b=1: adaptive / transformers prompt lookup", ratio("rewriting", 1, adaptive, lookup), ">= 1.1"),
           ("3", "open b=1: adaptive / transformers generate", ratio("open", 1, adaptive, TRANSFORMERS), ">= 0.95"),
           ("3", "rewriting b=16: adaptive / specbatch k=0", ratio("rewriting", 16, adaptive, "specbatch k=0"), ">= 1.5")]
    out += [("3", f"{w} b=1: specbatch k=0 / transformers generate", ratio(w, 1, "specbatch k=0", TRANSFORMERS), ">= 1.0")
            for w in cfg.workloads]
    for w in cfg.workloads:
        for b in cfg.batch_sizes:
            best = max((rate[(w, b, f)] for f in fixed if (w, b, f) in rate), default=None)
            value = rate[(w, b, adaptive)] / best if best and (w, b, adaptive) in rate else None
            out.append(("4", f"{w} b={b}: adaptive / best fixed k", value, "> 1.0" if w == "mix" else ">= 0.95"))
            out.append(("4", f"{w} b={b}: adaptive / k=0", ratio(w, b, adaptive, "specbatch k=0"), ">= 0.95"))
    checked = []
    for issue, check, value, target in out:
        op, bound = target.split()
        met = None if value is None else (value > float(bound) if op == ">" else value >= float(bound))
        checked.append((issue, check, value, target, met))
    return checked


def markdown(results: list[dict], meta: dict, cfg: BenchConfig, took_s: float) -> str:
    """The results as Markdown: a header naming command, date and machine, then the tables."""
    gen = [r for r in results if r["section"] == "generation"]
    lines = [
        "## specbatch bench" + (" (--quick)" if meta["quick"] else ""),
        "",
        (f"`{meta['command']}` on {meta['date']}; took {took_s:.0f} s; 1-minute load average "
         f"{_f(meta['load_at_start'], 2)} at the start, {_f(meta.get('load_at_end'), 2)} at the end."),
        (f"Machine: {meta['platform']} ({meta['machine']}), {meta['cpu_count']} CPUs, device {meta['device']}, "
         f"torch {meta['torch']} ({meta['threads']} threads for every system), transformers {meta['transformers']}."),
        f"Model {meta['model']} ({meta['dtype']})" + (f", draft {meta['draft']}" if meta["draft"] else "")
        + f"; greedy, max_new_tokens {meta['max_new_tokens']}; tokens/s is the median of {meta['repeats']} "
          "repeat(s) (min–max); × is over transformers `generate` at the same batch size and workload; "
          "tok/pass = generated tokens / target passes, tok/row-pass = generated / (rows summed over passes); "
          "α = acceptance by draft position; greedy = every output equals transformers' greedy output at batch 1. "
          f"Peak memory: {gen[0]['mem_method'] if gen else '–'}, all model copies included and paged in before "
          "timing; (+cell) is the peak over the memory in use when the cell started: the cell's own working set.",
        "",
        "| workload | batch | system | tok/s (min–max) | × | tok/pass | tok/row-pass | α1..α4 | mean k | peak MB (+cell) | greedy |",
        "|---|---:|---|---|---:|---:|---:|---|---:|---:|---|",
    ]
    for r in gen:
        lines.append(
            f"| {r['workload']} | {r['batch_size']} | {r['system']} | {_f(r['tokens_per_s'])} "
            f"({_f(r['tokens_per_s_min'])}–{_f(r['tokens_per_s_max'])}) | {_f(r['ratio_vs_transformers'], 2)} | "
            f"{_f(r['tokens_per_pass'], 2)} | {_f(r['tokens_per_row_pass'], 2)} | {_alphas(r['accept_by_position'])} | "
            f"{_mean_k(r['k_hist']) if r['family'] == SPECBATCH else '–'} | {_f(r['peak_mem_mb'], 0)} "
            f"(+{_f(r['peak_delta_mb'], 0)}) | "
            f"{_greedy(r)} |")
    pipe = [r for r in results if r["section"] == "pipeline"]
    if meta.get("pipeline_error"):
        lines += ["", f"Pipeline row FAILED: {meta['pipeline_error']}"]
    if pipe:
        lines += ["", ("Pipeline: the same rows as a whole job (Ray, planning, reading, writing, actor start and "
                       "model load included) against ShardRunner alone with the models already loaded "
                       "(goal: ratio >= 0.9)."), "",
                  "| workload | rows | batch | system | tok/s end to end | wall s | tok/s inside shards | outside shards s | ratio | greedy |",
                  "|---|---:|---:|---|---:|---:|---:|---:|---:|---|"]
        for r in pipe:
            lines.append(f"| {r['workload']} | {r['rows']} | {r['batch_size']} | {r['system']} | {_f(r['tokens_per_s'])} | "
                         f"{_f(r['wall_s'])} | {_f(r.get('steady_tokens_per_s'))} | {_f(r.get('startup_s'))} | "
                         f"{_f(r.get('ratio_vs_direct'), 2)} | {_greedy(r)} |")
    goals = goal_rows(results, cfg)
    if goals:
        lines += ["", (f"Goals (issues 3 and 4; adaptive = this generator with the {cfg.drafters[0]} drafter "
                       "and the adaptive controller):"), "",
                  "| issue | check | value | goal | met |", "|---|---|---:|---|---|"]
        lines += [f"| {i} | {c} | {_f(v, 2)} | {t} | {'–' if m is None else 'yes' if m else 'no'} |"
                  for i, c, v, t, m in goals]
    return "\n".join(lines) + "\n"


def plot(results: list[dict], cfg: BenchConfig, path: Path) -> None:
    """tokens/s by k (x) and batch size (colour) per workload; adaptive is a star, transformers a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    gen = [r for r in results if r["section"] == "generation"]
    ks = sorted(set(cfg.ks))
    drafter = cfg.drafters[0]
    fig, axes = plt.subplots(1, len(cfg.workloads), figsize=(4.2 * len(cfg.workloads), 3.8), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, workload in zip(axes[0], cfg.workloads):
        cells = {(r["batch_size"], r["system"]): r["tokens_per_s"] for r in gen if r["workload"] == workload}
        for i, b in enumerate(cfg.batch_sizes):
            color = colors[i % len(colors)]
            names = ["specbatch k=0" if k == 0 else f"specbatch {drafter} k={k}" for k in ks]
            points = [(x, cells[(b, n)]) for x, n in enumerate(names) if (b, n) in cells]
            if points:
                ax.plot(*zip(*points), "o-", color=color, label=f"specbatch b={b}")
            if (b, f"specbatch {drafter} adaptive") in cells:
                ax.scatter([len(ks)], [cells[(b, f"specbatch {drafter} adaptive")]], marker="*", s=260, color=color,
                           edgecolors="black", zorder=3, label=f"adaptive b={b}")
            if (b, TRANSFORMERS) in cells:
                ax.axhline(cells[(b, TRANSFORMERS)], color=color, linestyle="--", linewidth=1,
                           label=f"transformers b={b}")
        for j, (key, rate) in enumerate(sorted((s, v) for (b, s), v in cells.items()
                                               if b == 1 and s.startswith("transformers ") and s != TRANSFORMERS)):
            ax.axhline(rate, color="gray", linestyle=[":", "-.", (0, (1, 3))][j % 3], linewidth=1.2, label=f"{key} b=1")
        ax.set_xticks(range(len(ks) + 1), [str(k) for k in ks] + ["adaptive"])
        ax.set_xlabel("draft length k")
        ax.set_title(workload)
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    axes[0][0].set_ylabel("generated tokens/s")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=min(6, len(labels)), fontsize=8, frameon=False)
    fig.tight_layout(rect=(0, 0.06 + 0.04 * (len(labels) // 6), 1, 1))
    fig.savefig(path, dpi=120)
    plt.close(fig)


def write_outputs(results: list[dict], meta: dict, cfg: BenchConfig, took_s: float, out: Path) -> str:
    """results.parquet, results.md and plot.png in `out`; returns the Markdown."""
    out.mkdir(parents=True, exist_ok=True)
    table = pa.Table.from_pylist([{c: r.get(c) for c in COLUMNS} for r in results], schema=_SCHEMA)
    meta_json = json.dumps({**meta, "took_s": round(took_s, 1)})
    pq.write_table(table.replace_schema_metadata({"specbatch_bench": meta_json}), out / "results.parquet")
    text = markdown(results, meta, cfg, took_s)
    (out / "results.md").write_text(text)
    plot(results, cfg, out / "plot.png")
    return text


# ------------------------------------------------------------------------------------- entry point

def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def benchmark(cfg: BenchConfig, out: Path, command: str = "specbatch bench", quick: bool = False,
              log: Callable[[str], None] = _log) -> list[dict]:
    """Run everything the config asks for and write the outputs; returns the result rows."""
    started = time.perf_counter()
    device = resolve_device(cfg.device)
    torch.set_num_threads(os.cpu_count() or 1)
    log(f"loading {cfg.model.target} ({cfg.model.dtype}) on {device}, twice (transformers' copy and ours)")
    models = load_bench_models(cfg, device)
    workloads = build_workloads(cfg, models.tokenizer)
    meta = machine_info(cfg, device, command, quick)
    with torch.inference_mode():
        references = greedy_references(models, workloads, cfg.max_new_tokens, log)
        results = run_cells(cfg, models, workloads, references, log)
    if cfg.pipeline.enabled:
        write_outputs(results, meta, cfg, time.perf_counter() - started, out)  # the cells survive a failing job
        try:
            results += run_pipeline(cfg, models, workloads, references, log)
        except Exception as exc:  # noqa: BLE001 - report it with the cells rather than lose a long run
            meta["pipeline_error"] = f"{type(exc).__name__}: {exc}"
            log(f"pipeline row failed: {meta['pipeline_error']}")
    took = time.perf_counter() - started
    meta["load_at_end"] = _load_average()
    text = write_outputs(results, meta, cfg, took, out)
    print(text)
    log(f"bench took {took:.0f} s ({took / 60:.1f} min); wrote {out}/results.parquet, results.md, plot.png")
    return results


def run_bench(args: argparse.Namespace) -> int:
    """`specbatch bench [--config FILE] [--quick] [--out DIR]`."""
    command = f"specbatch bench --config {args.config}" + (" --quick" if args.quick else "") + f" --out {args.out}"
    try:
        cfg = load_bench_config(args.config, args.quick)
        results = benchmark(cfg, Path(args.out), command, args.quick)
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    return 1 if cfg.pipeline.enabled and not any(r["section"] == "pipeline" for r in results) else 0
