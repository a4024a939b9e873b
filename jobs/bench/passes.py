"""The engine alone, pass by pass: what one target pass costs at each batch size and width against the
memory-bandwidth floor and against transformers' own forward over the same cache, and how fast each
prefills the same prompts. Where the generation cells say how fast a system is, this says why: a
verify pass that costs much more than a plain one divides every speculative gain, and a pass far from
the floor has overhead to remove.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch
from transformers import DynamicCache

from jobs.bench.config import PassesBenchConfig
from jobs.bench.fmt import num, percent
from jobs.bench.roofline import Floor
from jobs.bench.timing import timed
from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel


def _median_time(device: torch.device, work: Callable[[], object], repeats: int) -> float:
    work()  # warm-up: first-call allocations, oneDNN's kernel choice, a compile
    return statistics.median(timed(device, work)[1] for _ in range(repeats))


def _left_padded(prompts: list[list[int]], pad: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and attention mask, left-padded as transformers' `generate` batches prompts."""
    longest = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (longest - len(p)) + p for p in prompts], device=device)
    mask = torch.tensor([[0] * (longest - len(p)) + [1] * len(p) for p in prompts], device=device)
    return ids, mask


def _hf_pass(model: torch.nn.Module, prompts: list[list[int]], width: int, pad: int) -> Callable[[], object]:
    """transformers' forward of `width` new tokens per row after the prompts, each repeat on the same cache
    cropped back."""
    ids, mask = _left_padded(prompts, pad, model.device)
    cache = DynamicCache(config=model.config)
    model(input_ids=ids, attention_mask=mask, cache=cache, use_cache=True)
    new = ids[:, -1:].repeat(1, width)
    full_mask = torch.cat([mask, mask.new_ones(len(prompts), width)], 1)

    def step():
        out = model(input_ids=new, attention_mask=full_mask, cache=cache, use_cache=True)
        cache.crop(-width)
        return out.logits
    return step


def _our_pass(target: DecodingModel, prompts: list[list[int]], width: int) -> Callable[[], object]:
    lm = CachedLM(target, len(prompts), max(len(p) for p in prompts) + width + 1)
    lm.prefill(prompts, 0)
    new = torch.tensor([[p[-1]] * width for p in prompts])
    return lambda: lm.logits(new)   # lengths do not advance: every repeat is the same pass


def _our_prefill(target: DecodingModel, prompts: list[list[int]]) -> Callable[[], object]:
    lm = CachedLM(target, len(prompts), max(len(p) for p in prompts) + 1)
    return lambda: lm.prefill(prompts, 0)


def _hf_prefill(model: torch.nn.Module, prompts: list[list[int]], pad: int) -> Callable[[], object]:
    ids, mask = _left_padded(prompts, pad, model.device)
    return lambda: model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)


def probe_passes(cfg: PassesBenchConfig, target: DecodingModel, prompts: list[list[int]], floor: Floor,
                 pad: int, log: Callable[[str], None]) -> list[dict]:
    """One row per (batch size, width): ms per pass for ours and transformers', the floor, and for width 1
    the prefill of the same prompts (tokens/s, each system's own way of batching them)."""
    device, rows = target.device, []
    compiled = DecodingModel.prepare(target.model, compile=True) if cfg.compile else None
    for batch in cfg.batch_sizes:
        chosen = (prompts * batch)[:batch]
        context = sum(len(p) for p in chosen) / batch
        for width in cfg.widths:
            with torch.inference_mode():
                ours = _median_time(device, _our_pass(target, chosen, width), cfg.repeats)
                theirs = _median_time(device, _hf_pass(target.model, chosen, width, pad), cfg.repeats)
                ours_compiled = (_median_time(device, _our_pass(compiled, chosen, width), cfg.repeats)
                                 if compiled is not None else None)
            floor_s = (floor.weights + floor.kv_per_token * batch * context) / floor.bandwidth
            row = {"batch_size": batch, "width": width, "context": context, "ms": 1e3 * ours,
                   "transformers_ms": 1e3 * theirs, "compiled_ms": None if ours_compiled is None else 1e3 * ours_compiled,
                   "floor_ms": 1e3 * floor_s, "floor_fraction": floor_s / ours}
            if width == min(cfg.widths):
                tokens = sum(len(p) - 1 for p in chosen)
                with torch.inference_mode():
                    row["prefill_tok_s"] = tokens / _median_time(device, _our_prefill(target, chosen), cfg.repeats)
                    row["transformers_prefill_tok_s"] = tokens / _median_time(
                        device, _hf_prefill(target.model, chosen, pad), cfg.repeats)
            rows.append(row)
            log(f"pass b={batch} w={width}: {row['ms']:.1f} ms (transformers {row['transformers_ms']:.1f}, "
                f"floor {row['floor_ms']:.1f})")
    width_one = {r["batch_size"]: r["ms"] for r in rows if r["width"] == min(cfg.widths)}
    for r in rows:
        r["vs_width_1"] = r["ms"] / width_one[r["batch_size"]]
    return rows


def passes_markdown(rows: list[dict]) -> list[str]:
    """The pass table of results.md."""
    if not rows:
        return []
    lines = ["Passes: one target pass over prompts of the workload (context = mean cached tokens per row), median "
             "of repeats; × width 1 = this pass over the width-1 pass at the same batch; prefill = the same prompts "
             "cached from scratch (transformers: one padded forward).", "",
             "| batch | width | context | ms/pass | × width 1 | transformers ms | compiled ms | floor ms | % floor "
             "| prefill tok/s | transformers prefill tok/s |",
             "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    lines += [f"| {r['batch_size']} | {r['width']} | {num(r['context'], 0)} | {num(r['ms'])} | {num(r['vs_width_1'], 2)} | "
              f"{num(r['transformers_ms'])} | {num(r['compiled_ms'])} | {num(r['floor_ms'])} | {percent(r['floor_fraction'])} | "
              f"{num(r.get('prefill_tok_s'), 0)} | {num(r.get('transformers_prefill_tok_s'), 0)} |" for r in rows]
    return lines
