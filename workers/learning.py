"""A job that learns its own drafter: what runs on the cluster (the driver's side: pipeline/learning.py).

- `learn_head`, a Ray task beside the workers: reads the job's committed completions back, distils an MTP
  head from them within the time budget, saves it under OUTPUT/drafters/ and returns its files, which the
  Ray object store then carries to every worker.
- its training data: the job's committed completions (workers/committed.py).
"""
from __future__ import annotations

import math
import time
from statistics import fmean

import torch

from workers.committed import HELDOUT_FRACTION, committed_sequences, is_heldout
from workers.config import JobConfig
from workers.engine.decoding_model import DecodingModel
from workers.model_paths import read_head_files
from workers.models import load_model, load_tokenizer
from workers.mtp_distill import distill_head, expected_speedup, measure_costs
from workers.mtp_head import head_parameters, save_head
from workers.registry import pick_device
from workers.storage import safe_url

_FINAL_SHARE = 0.15         # of the budget, kept for held-out scoring and saving


def learn_head(config_json: dict, data_urls: list[str], out_url: str, cpus: float) -> dict[str, bytes]:
    """Distil a head for the job's target from the completions in `data_urls` within
    speculation.learn_minutes (loading included), save it at `out_url` and return its files. Its report's
    `expected` is the speed-up over plain decoding that drafting with it at the job's batch size should give,
    from its held-out acceptance and the measured costs of a draft step and of verify passes."""
    started = time.perf_counter()
    config = JobConfig.model_validate(config_json)
    torch.set_num_threads(max(1, math.ceil(cpus)))
    m, options = config.model, config.input.storage_options
    budget = 60 * config.speculation.learn_minutes
    target = load_model(m.target, m.dtype, pick_device(), options, m.trust_remote_code)
    found = committed_sequences(data_urls, config, load_tokenizer(m.target, options, m.trust_remote_code))
    held = [seq for rid, seq in found if is_heldout(rid, HELDOUT_FRACTION)]
    train = [seq for rid, seq in found if not is_heldout(rid, HELDOUT_FRACTION)]
    split = bool(held and train)
    if not split:  # too few prompts to hold some out: score on training rows, and the report says so
        train = held = train or held
    head, result, scores = distill_head(target, m.target, train, held, started + budget * (1 - _FINAL_SHARE))
    rows = config.resources.batch_size
    costs = measure_costs(head, DecodingModel.prepare(target), rows, round(fmean(len(p) for p, _ in train)),
                          round(fmean(len(c) for _, c in train)))
    expected = {"batch_size": rows, **expected_speedup(scores["heldout_accept_by_position"], costs)}
    report = {"target": {"name": m.target, "dtype": str(target.dtype).removeprefix("torch."),
                         "device": str(target.device)},
              "workload": {"config": config.name, "source": f"job output {safe_url(config.output.path)}",
                           "shards": len(data_urls), "train_sequences": len(train), "heldout_sequences": len(held) if split else 0,
                           "train_completion_tokens": sum(len(c) for _, c in train)},
              "head": {"layers": head.spec.n_layers, "draft_vocab": head.spec.draft_vocab or head.spec.vocab_size,
                       "parameters": head_parameters(head)},
              "steps": result.steps, "curve": result.curve, **scores, "expected": expected,
              "minutes": {"training": result.seconds / 60, "total": (time.perf_counter() - started) / 60}}
    save_head(head, out_url, report, config.output.storage_options)
    return read_head_files(out_url, config.output.storage_options)
