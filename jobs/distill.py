"""`specbatch distill CONFIG`: build an MTP draft head for a job's target from the target's own completions.

The loop it serves: run a first slice of a big job, `specbatch distill CONFIG --from THAT_OUTPUT`, then run
the rest with `model.drafter: mtp` and `model.draft` naming the head. Without --from, the config's own
prompts are completed here by the project's generator with the config's sampling, so the head learns the
job's real workload. Prompts are split by id into a training and a held-out set; the report's acceptance is
measured on held-out prompts only. `--minutes` bounds the whole command, data generation included.
The command's options are defined with the others in jobs/cli.py.
"""
from __future__ import annotations

import argparse
import sys
import time

from tqdm import tqdm

from pipeline.config_file import load_config
from pipeline.planner import plan_shards
from workers.committed import Sequence, committed_sequences, is_heldout
from workers.config import JobConfig
from workers.engine.generator import Request, SpeculativeGenerator
from workers.mtp_distill import (
    distill_head,
    expected_speedup,
    measure_costs,
)
from workers.mtp_head import head_parameters, save_head
from workers.registry import Models, encode_prompt, load_models, make_generator, pick_device
from workers.shard_io import InputRow, read_shard
from workers.shard_runner import row_seed
from workers.storage import absolute, list_files, safe_url

FINAL_RESERVE_S = 60.0  # the end of the budget: final held-out scoring, cost measurement, save


class DistillError(ValueError):
    """Distillation cannot run as asked; the message says what is missing."""


def input_rows(config: JobConfig) -> list[InputRow]:
    """Every usable row of the config's input."""
    rows = [row for spec in plan_shards(config).shards for row in read_shard(spec, config.input)]
    return [row for row in rows if row.error is None]


def encode(config: JobConfig, tokenizer, row: InputRow) -> list[int]:
    """A row's prompt ids, as the job's workers encode them."""
    return encode_prompt(tokenizer, row.prompt, row.messages, config.generation.chat_template)


def generate(generator: SpeculativeGenerator, config: JobConfig, tokenizer, rows: list[InputRow], deadline: float,
             progress: bool) -> list[tuple[str, Sequence]]:
    """(row id, sequence) for rows (every sample, seeded as the job would), completed a few batches at a time
    in input order, so that held-out and training rows share the time, until the rows or the time run out."""
    requests = [Request(row.id, encode(config, tokenizer, row), row_seed(config.generation.seed, row.id, sample))
                for row in rows for sample in range(config.generation.samples_per_prompt)]
    chunk = 2 * config.resources.batch_size
    sequences: list[tuple[str, Sequence]] = []
    with tqdm(total=len(requests), desc="completions", unit="row", disable=not progress) as bar:
        for begin in range(0, len(requests), chunk):
            if time.perf_counter() >= deadline:
                break
            batch = requests[begin : begin + chunk]
            for request, done in zip(batch, generator.generate(batch).completions):
                if done.finish_reason != "error":
                    sequences.append((request.id, (request.prompt_ids, done.token_ids)))
            bar.update(len(batch))
    return sequences


def output_sequences(url: str, config: JobConfig, tokenizer) -> list[tuple[str, Sequence]]:
    """(row id, sequence) for every completed row of a job's output, prompts encoded as that job's worker did."""
    files = list_files(url.rstrip("/") + "/data", config.output.storage_options, [".parquet"])
    if not files:
        raise FileNotFoundError(f"{safe_url(url)} holds no job output (no data/*.parquet)")
    return committed_sequences(files, config, tokenizer)


def collect(args: argparse.Namespace, config: JobConfig, models: Models, started: float,
            budget: float) -> tuple[list[Sequence], list[Sequence], dict]:
    """Training and held-out sequences, and a description of where they came from."""
    if args.source:
        found = output_sequences(args.source, config, models.tokenizer)
        source = f"job output {safe_url(args.source)}"
    else:
        generating = config.model_copy(update={"model": config.model.model_copy(update={"drafter": "ngram"})})
        found = generate(make_generator(generating, models), config, models.tokenizer, input_rows(config),
                         started + args.data_share * budget, not args.quiet)
        source = f"generated here from {safe_url(config.input.path)}"
    train_seqs = [s for rid, s in found if not is_heldout(rid, args.heldout)]
    held_seqs = [s for rid, s in found if is_heldout(rid, args.heldout)]
    prompts = len({rid for rid, _ in found})
    if not train_seqs or not held_seqs:
        raise DistillError(f"distill needs completions of both training and held-out prompts; got {len(train_seqs)} "
                           f"training and {len(held_seqs)} held-out sequences (more prompts, time or --heldout)")
    g = config.generation
    workload = {"config": config.name, "source": source, "prompts": prompts,
                "sampling": {"temperature": g.temperature, "top_p": g.top_p, "top_k": g.top_k},
                "max_new_tokens": g.max_new_tokens, "chat_template": g.chat_template,
                "train_sequences": len(train_seqs), "heldout_sequences": len(held_seqs),
                "train_completion_tokens": sum(len(c) for _, c in train_seqs),
                "heldout_completion_tokens": sum(len(c) for _, c in held_seqs),
                "mean_prompt_tokens": sum(len(p) for p, _ in train_seqs) / len(train_seqs),
                "mean_completion_tokens": sum(len(c) for _, c in train_seqs) / len(train_seqs)}
    return train_seqs, held_seqs, workload


def run_distill(args: argparse.Namespace) -> int:
    started = time.perf_counter()
    config = load_config(args.config, args.set)
    out = absolute(args.out) if args.out else (config.model.draft if config.model.drafter == "mtp" else None)
    if not out:
        print("error: say where the head goes: --out PATH (or model.draft with model.drafter: mtp)", file=sys.stderr)
        return 2
    budget, progress = args.minutes * 60, not args.quiet
    m, device = config.model, pick_device()
    # The target as a worker prepares it (kernel choice included), so the speed estimate times the job's engine.
    models: Models = load_models(config.model_copy(update={"model": m.model_copy(update={"drafter": "none"})}), device,
                                 transformers_model=True)  # features come from transformers' forward
    target = models.target.model
    try:
        train_seqs, held_seqs, workload = collect(args, config, models, started, budget)
    except (DistillError, FileNotFoundError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    data_s = time.perf_counter() - started
    head, result, scores = distill_head(target, m.target, train_seqs, held_seqs, started + budget - FINAL_RESERVE_S,
                                        layers=args.layers, draft_vocab=args.draft_vocab, depth=args.depth,
                                        max_steps=args.steps, clock_start=started, progress=progress)
    spec = head.spec
    report = {
        "target": {"name": m.target, "hidden_size": spec.hidden_size, "vocab_size": spec.vocab_size,
                   "dtype": str(target.dtype).removeprefix("torch."), "device": str(device)},
        "workload": workload,
        "head": {"layers": spec.n_layers, "draft_vocab": spec.draft_vocab or spec.vocab_size,
                 "parameters": head_parameters(head), "depth_trained": args.depth},
        "minutes": {"data": data_s / 60, "training": result.seconds / 60},
        "steps": result.steps,
        "curve": result.curve,
        **scores,
    }
    report["speed"] = {}
    for rows in sorted({1, config.resources.batch_size}):
        costs = measure_costs(head, models.target, rows, round(workload["mean_prompt_tokens"]),
                              round(workload["mean_completion_tokens"]))
        report["speed"][f"batch_{rows}"] = {
            "prefill_ms": 1e3 * costs["prefill_s"], "draft_ms": 1e3 * costs["draft_s"],
            "verify_ms": {q: 1e3 * s for q, s in costs["verify_s"].items()},
            "expected": expected_speedup(report["heldout_accept_by_position"], costs)}
    report["minutes"]["total"] = (time.perf_counter() - started) / 60
    report["minutes"]["cpu_total"] = time.process_time() / 60  # CPU time of all threads: the machine's share
    save_head(head, out, report, config.output.storage_options)
    print(describe(report, out))
    return 0


def describe(report: dict, out: str) -> str:
    numbers = lambda xs: ", ".join(f"{x:.2f}" for x in xs)  # noqa: E731
    w = report["workload"]
    lines = [f"MTP head for {report['target']['name']} saved to {safe_url(out)}",
             f"  {report['steps']} steps in {report['minutes']['total']:.1f} min "
             f"({w['train_completion_tokens']} training completion tokens); stopped: {report['stopped']}; kept the "
             f"weights of step {report['kept_step']} (best held-out acceptance at position 1)",
             f"  held-out acceptance by draft position, conditional (of the drafts at position d whose positions "
             f"1..d-1 were accepted, the share accepted): {numbers(report['heldout_accept_by_position'])}",
             f"  held-out drafts reaching position d, unconditional (all of 1..d accepted): "
             f"{numbers(report['heldout_reach_by_position'])}"]
    for name, speed in report["speed"].items():
        e = speed["expected"]
        lines.append(f"  {name.replace('_', ' ')}: draft/verify cost {e['cost_ratio']:.3f}, expected speed-up "
                     f"{e['speedup']:.2f}x at k={e['k']} (warmed-up timings; {w['mean_prompt_tokens']:.0f}-token "
                     f"prompts' prefill and {w['mean_completion_tokens']:.0f} new tokens a row)")
    return "\n".join(lines)
