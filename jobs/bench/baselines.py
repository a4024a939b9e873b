"""transformers' own `generate` as the baselines (plain, prompt lookup, assisted with a draft model) and as
the oracle: its greedy output at batch 1 is what every system's output must equal."""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from typing_extensions import Self

from jobs.bench.config import BenchConfig
from jobs.bench.models import BenchModels
from jobs.bench.peer_protocol import cut_at_eos   # transformers pads finished rows after their EOS
from jobs.bench.roofline import kv_token_reads
from jobs.bench.systems import Run, System
from jobs.bench.timing import timed
from jobs.bench.workloads import Prompt


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


def _generate_options(system: System, models: BenchModels) -> dict[str, Any]:
    if system.drafter == "prompt-lookup":
        return {"prompt_lookup_num_tokens": system.k}
    if system.drafter == "model":
        config = models.hf_draft.generation_config
        config.num_assistant_tokens_schedule = system.schedule
        config.num_assistant_tokens = None  # the heuristic persists across calls; every run starts from the default
        return {"assistant_model": models.hf_draft}
    return {}


def run_transformers(system: System, models: BenchModels, prompts: list[Prompt], batch_size: int,
                     max_new_tokens: int, cfg: BenchConfig) -> Run:
    """transformers in chunks of `batch_size`, prompts sorted by length (less padding: the same favour
    this generator's length-sorted admission gets). Every row of a chunk takes part in all its passes."""
    extra = _generate_options(system, models)
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i].ids))
    outputs: list[list[int]] = [[] for _ in prompts]
    kv = 0.0

    def generate_all() -> None:
        nonlocal kv
        for at in range(0, len(order), batch_size):
            chunk, before = order[at : at + batch_size], counter.passes
            done = hf_generate(models.hf_target, [prompts[i].ids for i in chunk], models, max_new_tokens, **extra)
            for i, tokens in zip(chunk, done):
                outputs[i] = tokens
                kv += kv_token_reads(counter.passes - before, len(prompts[i].ids), len(tokens))

    with PassCounter(models.hf_target) as counter:
        _, wall = timed(models.device, generate_all)
    return Run(outputs, wall, counter.passes, counter.rows, kv, [], [])


def greedy_references(models: BenchModels, prompts: list[Prompt], max_new_tokens: int,
                      log: Callable[[str], None]) -> dict[tuple[int, ...], list[int]]:
    """transformers' greedy `generate` at batch 1, once per distinct prompt: the oracle outputs must equal."""
    distinct = list(dict.fromkeys(p.ids for p in prompts))
    log(f"greedy references: {len(distinct)} prompts x {max_new_tokens} tokens with transformers at batch 1")
    return {ids: hf_generate(models.hf_target, [ids], models, max_new_tokens)[0] for ids in distinct}
