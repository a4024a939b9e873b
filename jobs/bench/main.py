"""`specbatch bench`: load once, run the cells (and the pipeline row), write and print the results."""
from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch

from jobs.bench.baselines import greedy_references
from jobs.bench.cells import run_cells
from jobs.bench.config import BenchConfig, BenchError, load_bench_config, resolve_device
from jobs.bench.long_prefill import probe_long_prefill
from jobs.bench.models import load_bench_models
from jobs.bench.passes import probe_passes
from jobs.bench.peers import PeerPool
from jobs.bench.pipeline import run_pipeline
from jobs.bench.report import load_average, machine_info, write_outputs
from jobs.bench.roofline import Floor
from jobs.bench.workloads import Prompt, build_workloads, skipped_cells
from workers.models import local_model_dir


def _log(message: str) -> None:
    print(message, file=sys.stderr, flush=True)


def peer_context(cfg: BenchConfig, workloads: dict[str, list[Prompt]]) -> int:
    """The context a peer's engine needs: the longest prompt (the long-prompt probe's included), its completion and
    a draft, rounded up to 256."""
    longest = max((len(p.ids) for prompts in workloads.values() for p in prompts), default=0)
    longest = max([longest, *(cfg.prefill.lengths if cfg.prefill.enabled else [])])
    need = longest + max(cfg.max_new_tokens, cfg.warmup_tokens) + cfg.prompt_lookup_num_tokens + 16
    return -(-need // 256) * 256


def benchmark(cfg: BenchConfig, out: Path, command: str = "specbatch bench", quick: bool = False,
              log: Callable[[str], None] = _log) -> list[dict]:
    """Run everything the config asks for and write the outputs; returns the result rows."""
    started = time.perf_counter()
    device = resolve_device(cfg.device)
    torch.set_num_threads(cfg.threads or os.cpu_count() or 1)
    log(f"loading {cfg.model.target} ({cfg.model.dtype}) on {device}")
    models = load_bench_models(cfg, device)
    workloads = build_workloads(cfg, models.tokenizer)
    floor = Floor.measure(models.hf_target, device)
    log(f"{len(workloads)} workloads from the suite's {cfg.split} split; bandwidth {floor.bandwidth / 1e9:.1f} GB/s")
    meta = {**machine_info(cfg, device, command, quick, floor), "skipped": skipped_cells(cfg, workloads)}
    for cell in meta["skipped"]:
        log(f"skipped {cell}: the {cfg.split} split has too few prompts to fill it")
    peers = PeerPool(cfg, device.type, lambda: local_model_dir(cfg.model.target), torch.get_num_threads(),
                     peer_context(cfg, workloads), models.eos_ids, log)
    meta["peers"] = peers.notes
    with torch.inference_mode():
        checked = [p for prompts in workloads.values() for p in prompts[: cfg.reference_rows]]
        references = greedy_references(models, checked, cfg.max_new_tokens, log)
        try:
            results = run_cells(cfg, models, workloads, references, floor, log, peers)
            if cfg.prefill.enabled:
                meta["long_prefill"] = probe_long_prefill(cfg.prefill, models.by_drafter["none"].target, workloads,
                                                          peers, log)
        finally:
            peers.close()
    if cfg.passes.enabled:
        prompts = [list(p.ids) for p in workloads.get("mix") or next(iter(workloads.values()))]
        meta["passes"] = probe_passes(cfg.passes, models.by_drafter["none"].target, prompts, floor, models.pad_id, log)
    if cfg.pipeline.enabled:
        write_outputs(results, meta, cfg, time.perf_counter() - started, out)  # the cells survive a failing job
        try:
            results += run_pipeline(cfg, models, workloads, references, log)
        except Exception as exc:  # noqa: BLE001 - report it with the cells rather than lose a long run
            meta["pipeline_error"] = f"{type(exc).__name__}: {exc}"
            log(f"pipeline row failed: {meta['pipeline_error']}")
    took = time.perf_counter() - started
    meta["load_at_end"] = load_average()
    text = write_outputs(results, meta, cfg, took, out)
    print(text)
    log(f"bench took {took:.0f} s ({took / 60:.1f} min); wrote {out}/results.parquet, traces.parquet, results.md, plot.png")
    return results


def run_bench(args: argparse.Namespace) -> int:
    """`specbatch bench [--config FILE] [--quick] [--split tune|report] [--out DIR]`."""
    split = getattr(args, "split", None)
    command = (f"specbatch bench --config {args.config}" + (" --quick" if args.quick else "")
               + (f" --split {split}" if split else "") + f" --out {args.out}")
    try:
        cfg: BenchConfig = load_bench_config(args.config, args.quick, split)
        results = benchmark(cfg, Path(args.out).resolve(), command, args.quick)  # printed: absolute
    except BenchError as exc:
        print(f"bench: {exc}", file=sys.stderr)
        return 2
    return 1 if cfg.pipeline.enabled and not any(r["section"] == "pipeline" for r in results) else 0
