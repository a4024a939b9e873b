"""The bench's workloads: the suite's categories (one split of them) and `mix`, the categories interleaved.

Every prompt is encoded once, as a worker encodes a row (the chat template when the tokenizer has
one), so every system decodes the very same token ids. A cell at batch size b runs the first
`cfg.rows(b)` prompts of its workload: cells at larger batch sizes extend the smaller ones' rows, and
the mix's rows are the categories' first prompts, so references are shared across cells. A category
with fewer prompts than a cell needs skips that cell (the mix, drawn from every category, can fill
batches no single category can), and the report says which cells were skipped.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from jobs.bench.config import BenchConfig, BenchError
from jobs.suite import SuiteError, SuitePrompt, interleave, load_suite
from workers.registry import encode_prompt

MIX = "mix"


@dataclass(frozen=True)
class Prompt:
    source: SuitePrompt
    ids: tuple[int, ...]

    @property
    def id(self) -> str:
        return self.source.id


def build_workloads(cfg: BenchConfig, tokenizer: Any) -> dict[str, list[Prompt]]:
    """workload -> its prompts in suite order: each category, then `mix` when the config asks for it."""
    try:
        suite = load_suite(cfg.split, cfg.categories, cfg.suite)
    except SuiteError as exc:
        raise BenchError(f"suite: {exc}") from None
    need = max(cfg.rows(b) for b in cfg.batch_sizes)
    chat = bool(getattr(tokenizer, "chat_template", None))
    workloads = {c: [_encode(tokenizer, p, chat) for p in prompts[:need]] for c, prompts in suite.items()}
    if cfg.mix:
        by_id = {p.id: p for prompts in workloads.values() for p in prompts}
        mixed = interleave({c: [p.source for p in prompts] for c, prompts in workloads.items()})
        workloads[MIX] = [by_id[p.id] for p in mixed[:need]]
    return workloads


def _encode(tokenizer: Any, prompt: SuitePrompt, chat: bool) -> Prompt:
    if prompt.messages is not None and not chat:
        raise BenchError(f"{prompt.id} is a conversation but the tokenizer has no chat template")
    return Prompt(prompt, tuple(encode_prompt(tokenizer, prompt.prompt, prompt.messages, chat)))


def cell_rows(prompts: list[Prompt], cfg: BenchConfig, batch_size: int) -> list[Prompt] | None:
    """The rows a cell at this batch size runs; None when the workload has too few prompts to fill it."""
    rows = cfg.rows(batch_size)
    return prompts[:rows] if len(prompts) >= rows else None


def skipped_cells(cfg: BenchConfig, workloads: dict[str, list[Prompt]]) -> list[str]:
    """The cells too few prompts leave out, as `workload b=N (M prompts)`."""
    return [f"{w} b={b} ({len(prompts)} prompts)" for b in cfg.batch_sizes for w, prompts in workloads.items()
            if cell_rows(prompts, cfg, b) is None]
