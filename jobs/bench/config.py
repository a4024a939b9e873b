"""What `specbatch bench` runs (configs/bench.yaml documents every key), and the job config a worker
would get for each of its systems: the bench builds generators and models through the workers' registry
from that job config, so it measures exactly what a job runs."""
from __future__ import annotations

import os
from pathlib import Path
from typing import Literal

import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from jobs.suite import SPLITS, SUITE_DIR
from workers.config import JobConfig, validation_message
from workers.models import DEMO_MODEL
from workers.registry import DRAFTERS, pick_device


class BenchError(ValueError):
    """The benchmark cannot run as configured; the message says why and what to do."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BenchModelConfig(_Strict):
    target: str = DEMO_MODEL
    draft: str | None = None     # a draft model sharing the tokenizer: transformers' assisted generation and `model`
    mtp_head: str | None = None  # a head from `specbatch distill` for this target: the `mtp` drafter's model.draft
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    compile: bool = False        # model.compile for this generator's systems (transformers always runs eager)


class PipelineBenchConfig(_Strict):
    enabled: bool = True
    workload: str = "mix"
    copies: int = Field(1, ge=1)
    batch_size: int = Field(16, ge=1)
    k: int | Literal["adaptive"] = "adaptive"
    rows_per_shard: int = Field(16, ge=1)


class PassesBenchConfig(_Strict):
    enabled: bool = True
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 8, 16], min_length=1)
    widths: list[int] = Field(default_factory=lambda: [1, 9], min_length=1)
    repeats: int = Field(7, ge=1)
    compile: bool = False   # also time model.compile's passes (the first ones compile: minutes on a small CPU)


class PrefillBenchConfig(_Strict):
    enabled: bool = True
    lengths: list[int] = Field(default_factory=lambda: [512], min_length=1)   # prompt tokens
    repeats: int = Field(3, ge=1)


class BenchConfig(_Strict):
    model: BenchModelConfig = Field(default_factory=BenchModelConfig)
    device: Literal["cpu", "cuda", "auto"] = "cpu"
    threads: int | None = Field(None, ge=1)   # torch threads for every system (None: one per CPU)
    suite: str = str(SUITE_DIR)
    split: Literal[SPLITS] = "report"
    categories: list[str] | None = Field(None, min_length=1)   # None: every category in the suite
    mix: bool = True                                           # plus a `mix` workload: the categories interleaved
    rows_by_batch: dict[int, int] = Field(default_factory=dict)  # rows a cell runs at a batch size (default: the batch size)
    reference_rows: int = Field(1, ge=0)   # rows per workload checked against transformers' greedy output at batch 1
    batch_sizes: list[int] = Field(default_factory=lambda: [1, 4, 16], min_length=1)
    ks: list[int] = Field(default_factory=lambda: [0, 2, 4, 8])
    adaptive: bool = True
    max_k: int = Field(8, ge=1, le=64)
    drafters: list[str] = Field(default_factory=lambda: ["ngram"], min_length=1)   # registered names; `suffix+ngram` composes
    ngram_size: int = Field(3, ge=1)
    max_new_tokens: int = Field(32, ge=1)
    repeats: int = Field(2, ge=1)
    warmup_tokens: int = Field(8, ge=1)
    prompt_lookup: bool = True   # transformers' prompt lookup at batch 1
    prompt_lookup_num_tokens: int = Field(10, ge=1)
    assistant_schedules: list[Literal["heuristic", "heuristic_transient", "constant"]] = Field(
        default_factory=lambda: ["heuristic", "constant"])
    peers: list[Literal["llama.cpp", "vllm"]] = Field(default_factory=lambda: ["llama.cpp", "vllm"])  # where installed
    pipeline: PipelineBenchConfig = Field(default_factory=PipelineBenchConfig)
    passes: PassesBenchConfig = Field(default_factory=PassesBenchConfig)
    prefill: PrefillBenchConfig = Field(default_factory=PrefillBenchConfig)

    @model_validator(mode="after")
    def _consistent(self) -> BenchConfig:
        if any(k < 0 or k > self.max_k for k in self.ks):
            raise ValueError(f"ks must lie in 0..max_k ({self.max_k}), got {self.ks}")
        if any(n < 2 for n in self.prefill.lengths):
            raise ValueError(f"prefill.lengths must be >= 2 prompt tokens, got {self.prefill.lengths}")
        if any(b < 1 for b in self.batch_sizes):
            raise ValueError("batch_sizes must be >= 1")
        short = {b: n for b, n in self.rows_by_batch.items() if n < b}
        if short:
            raise ValueError(f"rows_by_batch {short}: a cell needs at least as many rows as its batch size")
        unknown = [d for d in self.drafters if any(part not in DRAFTERS or part == "none" for part in d.split("+"))]
        if unknown:
            raise ValueError(f"drafters {unknown} are not registered (workers/registry.py has "
                             f"{sorted(set(DRAFTERS) - {'none'})}, composed as `a+b`; k = 0 is always run)")
        for drafter in self.drafters:   # what a job would refuse (a drafter needing model.draft), refused here
            try:
                job_config(self, drafter, 1, 1)
            except ValidationError as exc:
                raise ValueError(f"drafter {drafter!r}: {' '.join(validation_message(exc).split())}") from None
        return self

    def rows(self, batch_size: int) -> int:
        return self.rows_by_batch.get(batch_size, batch_size)


def job_config(cfg: BenchConfig, drafter: str, k: int | str, batch_size: int, max_new_tokens: int | None = None,
               input_path: str = "bench", output_path: str = "bench-out", rows_per_shard: int = 256) -> JobConfig:
    """The job a user would write for these settings; the bench's generators and pipeline row are built from it."""
    m, parts = cfg.model, drafter.split("+")
    draft = m.mtp_head if "mtp" in parts else m.draft
    return JobConfig.model_validate({
        "name": "bench",
        "input": {"path": input_path, "messages_column": "messages", "id_column": "id"},
        "output": {"path": output_path},
        "model": {"target": m.target, "dtype": m.dtype, "drafter": parts if len(parts) > 1 else drafter,
                  "compile": m.compile, **({"draft": draft} if draft else {})},
        "generation": {"max_new_tokens": max_new_tokens or cfg.max_new_tokens, "temperature": 0.0},
        "speculation": {"k": k, "max_k": cfg.max_k if k == "adaptive" else int(k), "ngram_size": cfg.ngram_size},
        "resources": {"workers": 1, "cpus_per_worker": float(os.cpu_count() or 1), "batch_size": batch_size},
        "sharding": {"rows_per_shard": rows_per_shard},
    })


def _merge(base: dict, over: dict) -> dict:
    """Deep-merge `over` into a copy of `base` (sections merge, other values replace)."""
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def _against(folder: Path, value: str | None) -> str | None:
    """A relative local path in a config file means relative to the file's folder (as job configs do)."""
    if value is None or ":" in value or Path(value).expanduser().is_absolute():
        return value
    return str(folder / value) if (folder / value).exists() else value


def load_bench_config(source: str | Path | dict, quick: bool = False, split: str | None = None,
                      overrides: dict | None = None) -> BenchConfig:
    """A BenchConfig from a YAML file or a dict; `quick` applies the `quick:` section on top, then `overrides`
    (merged section by section) and `split`."""
    if isinstance(source, dict):
        data = dict(source)
    else:
        path = Path(source)
        if not path.is_file():
            raise BenchError(f"{source}: no such bench config")
        data = yaml.safe_load(path.read_text()) or {}
        folder = path.resolve().parent
        if "suite" in data:
            data["suite"] = _against(folder, data["suite"])
        if isinstance(data.get("model"), dict):
            data["model"] = {key: _against(folder, value) if key in ("target", "draft", "mtp_head") else value
                             for key, value in data["model"].items()}
    quick_section = data.pop("quick", None) or {}
    if quick:
        data = _merge(data, quick_section)
    data = _merge(data, overrides or {})
    if split is not None:
        data["split"] = split
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
    return pick_device() if name == "auto" else torch.device(name)
