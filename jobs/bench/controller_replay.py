"""Adaptive k against every fixed k on many prompts, in minutes: `python -m jobs.bench.controller_replay`.

The bench's controller table runs each system for real, so a cell holds a few prompts and its ratio moves with
the machine. Greedy decoding with a model-free drafter makes a cheaper, larger test exact: the tokens do not
depend on the drafter or k, and a draft is accepted exactly while it equals them. So each prompt is generated
once at k = 0, one pass of each width is timed on this machine (median of several), and then every controller
is replayed over the same completions (jobs/draft_replay.py), each step priced at its width's measured time
with 5 % log-normal noise (the controller learns its costs from those prices, as in a run). Rows run one after
another in groups, as the bench's cells run them, and a controller's cost table lives on across groups, as it
does in a worker.

Two ratios per category: on the decisions alone, and with the controller's own time, measured here and scaled
by `--controller-factor` (inside a run a plan costs about twice what it costs here: the caches are cold after a
pass; measured on this CPU at batch 1, 1.2-1.6 ms a plan in a run against 0.6-0.8 ms replayed).
"""
from __future__ import annotations

import argparse
import os
from collections.abc import Callable

import numpy as np
import torch

from jobs.bench.passes import _median_time, _our_pass
from jobs.draft_replay import replay
from jobs.suite import SPLITS, load_suite
from pipeline.config_file import load_config
from workers.engine.controller import AdaptiveK, Controller, FixedK
from workers.engine.costs import CostModel
from workers.engine.drafter import Drafter
from workers.engine.generator import Request
from workers.registry import encode_prompt, load_models, make_drafter, make_generator, pick_device, sampling_params

DEMO = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "demo.yaml")


def pass_costs(target, prompt: list[int], widths: range, repeats: int = 9) -> dict[int, float]:
    """Median seconds of one batch-1 pass of each width after `prompt` (the pass table's own timing)."""
    return {width: _median_time(target.device, _our_pass(target, [prompt], width), repeats) for width in widths}


def rate(make: Callable[[], Controller], drafter: Drafter, rows: list[tuple[list[int], list[int]]], group: int,
         costs: dict[int, float], max_new_tokens: int, factor: float) -> tuple[float, float, float]:
    """(tokens/s on decisions alone, tokens/s with the controller's time x factor, controller ms per step)."""
    tokens = seconds = controller_s = 0.0
    steps = 0
    for start in range(0, len(rows), group):
        noise = np.random.default_rng(start)
        stats = replay(drafter, make(), [p for p, _ in rows[start : start + group]],
                       [c for _, c in rows[start : start + group]], max_new_tokens,
                       lambda width: costs[width] * noise.lognormal(0.0, 0.05))
        tokens, seconds = tokens + stats.generated_tokens, seconds + stats.verify_s
        controller_s, steps = controller_s + stats.controller_s, steps + stats.target_passes
    return tokens / seconds, tokens / (seconds + factor * controller_s), 1e3 * controller_s / max(steps, 1)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--split", choices=SPLITS, default="report", help="the suite half to replay")
    parser.add_argument("--per-category", type=int, default=12, help="prompts per category")
    parser.add_argument("--group", type=int, default=3, help="rows per generate call (the bench's cells: 3)")
    parser.add_argument("--ks", default="0,2,4,6,8", help="fixed k to compare against")
    parser.add_argument("--max-k", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=96)
    parser.add_argument("--controller-factor", type=float, default=2.0)
    args = parser.parse_args(argv)
    torch.set_num_threads(os.cpu_count() or 1)
    config = load_config(DEMO, ["speculation.k=0", "resources.batch_size=1",
                                f"generation.max_new_tokens={args.max_new_tokens}"])
    models = load_models(config, pick_device())
    generator = make_generator(config, models)
    suite = load_suite(args.split)
    rows = {}
    for category, prompts in suite.items():
        ids = [encode_prompt(models.tokenizer, None, p.chat(), True) for p in prompts[: args.per_category]]
        done = generator.generate([Request(str(i), p, 0) for i, p in enumerate(ids)]).completions
        rows[category] = [(p, list(c.token_ids)) for p, c in zip(ids, done)]
    costs = pass_costs(models.target, rows[next(iter(rows))][0][0], range(1, args.max_k + 2))
    def drafter() -> Drafter:   # a fresh one per system and category: prompt lookup learns its odds as it drafts
        return make_drafter("ngram", models, config.speculation, sampling_params(config))
    learnt = CostModel()   # adaptive's cost table, kept across groups as a worker keeps it
    systems = {f"k={k}": (lambda k=k: FixedK(k)) for k in map(int, args.ks.split(","))}
    systems["adaptive"] = lambda: AdaptiveK(args.max_k, 1, costs=learnt, prior=drafter().acceptance_prior)
    print(f"load average {os.getloadavg()[0]:.2f}; {args.split} half, {args.per_category} prompts a category in groups "
          f"of {args.group}, n-gram drafts, {args.max_new_tokens} new tokens; ms per pass by width: "
          + ", ".join(f"{w}: {1e3 * s:.1f}" for w, s in costs.items()))
    print("| category | best fixed | best fixed tok/s | adaptive ÷ best fixed (decisions) | with controller time "
          "| controller ms/step |\n|---|---|---:|---:|---:|---:|")
    ratios = []
    for category, category_rows in rows.items():
        results = {name: rate(make, drafter(), category_rows, args.group, costs, args.max_new_tokens,
                              args.controller_factor) for name, make in systems.items()}
        best = max((name for name in results if name != "adaptive"), key=lambda name: results[name][0])
        adaptive = results["adaptive"]
        ratios.append((adaptive[0] / results[best][0], adaptive[1] / results[best][1]))
        print(f"| {category} | {best} | {results[best][0]:.1f} | {ratios[-1][0]:.3f} | {ratios[-1][1]:.3f} "
              f"| {adaptive[2]:.3f} |")
    low, mean = np.min(ratios, 0), np.mean(ratios, 0)
    print(f"| all | | | {mean[0]:.3f} (min {low[0]:.3f}) | {mean[1]:.3f} (min {low[1]:.3f}) | |")


if __name__ == "__main__":
    main()
