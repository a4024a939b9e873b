"""`python -m jobs.bench.coupling CONFIG --head HEAD`: what drafter-invariant sampling costs, in acceptance and in time.

Acceptance: the config's held-out prompts (the split `specbatch distill --heldout` made) are generated with the MTP
head at HEAD and a fixed k, at each temperature, under both values of `speculation.sampling`: accepted / drafted
and tokens per row per target pass, and whether the completions equal plain decoding's (k = 0) token for token.
Per position, rejection sampling accepts with probability 1 - TV(p, q) and the shared-noise race with at least
(1 - TV) / (1 + TV) (Daliri et al. 2024).
Time: milliseconds per verify step that drawing the target's tokens takes at each batch x width (the race over
the whole vocabulary against the inverse-CDF draw the rejection rule makes), beside one target pass of that shape.
"""
from __future__ import annotations

import argparse

import torch

from jobs.bench.passes import _median_time, _our_pass
from jobs.distill import encode, input_rows, is_heldout
from pipeline.config_file import load_config
from workers.engine.generator import Request
from workers.engine.sampling import SamplingParams, inverse_cdf, probabilities, race, uniforms
from workers.engine.stats import GenerationStats
from workers.registry import Models, load_models, make_generator
from workers.shard_runner import row_seed


def acceptance_table(path: str, overrides: list[str], models: Models, args: argparse.Namespace) -> list[str]:
    """Markdown rows: per temperature and coupling, acceptance, tokens per row per pass, rows equal to k = 0's."""
    config = load_config(path, overrides)
    rows = [row for row in input_rows(config) if is_heldout(row.id, args.heldout)][: args.prompts]
    requests = [Request(row.id, encode(config, models.tokenizer, row), row_seed(config.generation.seed, row.id, 0))
                for row in rows]
    lines = [f"{len(requests)} held-out prompts, batch {args.batch}, k = {args.k}, MTP head {args.head}:",
             "| temperature | sampling | acceptance | tokens per row per pass | rows equal to k = 0 |",
             "|---|---|---|---|---|"]
    for temperature in args.temperatures:
        sampled = overrides + [f"generation.temperature={temperature}"]
        _, plain = _generate(path, sampled + ["speculation.k=0"], models, requests)
        for coupling in ("invariant", "rejection"):
            stats, tokens = _generate(path, sampled + [f"speculation.sampling={coupling}"], models, requests)
            same = sum(a == b for a, b in zip(tokens, plain))
            lines.append(f"| {temperature:g} | {coupling} | {stats.accepted_tokens / max(stats.drafted_tokens, 1):.3f} "
                         f"| {stats.generated_tokens / stats.row_passes:.2f} | {same}/{len(tokens)} |")
    return lines


def _generate(path: str, overrides: list[str], models: Models, requests: list[Request]
              ) -> tuple[GenerationStats, list[list[int]]]:
    result = make_generator(load_config(path, overrides), models).generate(requests)
    return result.stats, [c.token_ids for c in result.completions]


def noise_table(models: Models, repeats: int) -> list[str]:
    """Markdown rows: per batch x width, the race's and the inverse-CDF draw's milliseconds and a target pass's."""
    vocab = models.target.head_weight.shape[1]
    threads = torch.get_num_threads()
    title = f"drawing the target's tokens over a vocabulary of {vocab}, {threads} threads, median of {repeats} (ms):"
    header = "| batch | width | race (invariant) | inverse CDF (rejection) | target pass |"
    lines = [title, header, "|---|---|---|---|---|"]
    for batch in (1, 4, 16):
        for width in (1, 5, 9):
            ms = " | ".join(f"{1e3 * t:.2f}" for t in _draw_seconds(models, batch, width, repeats))
            lines.append(f"| {batch} | {width} | {ms} |")
    return lines


def _draw_seconds(models: Models, batch: int, width: int, repeats: int) -> list[float]:
    vocab, device = models.target.head_weight.shape[1], torch.device("cpu")
    probs = probabilities(torch.randn(batch, width, vocab) * 3, SamplingParams(0.8))
    seeds, starts = list(range(batch)), [100] * batch
    works = (lambda: race(probs, seeds, starts), lambda: inverse_cdf(probs, uniforms(seeds, starts, width, stream=0)),
             _our_pass(models.target, [[1] * 64] * batch, width))
    return [_median_time(device, work, repeats) for work in works]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.bench.coupling", description=__doc__.split("\n\n")[0])
    p.add_argument("config", help="a job config whose target the head was distilled for (its input gives the prompts)")
    p.add_argument("--head", required=True, help="the MTP head's folder (`specbatch distill --out`)")
    p.add_argument("--heldout", type=float, default=0.25, help="the distill run's --heldout fraction")
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--k", type=int, default=4)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.8, 1.0])
    p.add_argument("--repeats", type=int, default=9, help="timed repeats per noise cell")
    p.add_argument("--only", choices=["acceptance", "noise"], default=None)
    args = p.parse_args(argv)
    overrides = ["model.drafter=mtp", f"model.draft={args.head}", f"speculation.k={args.k}",
                 f"speculation.max_k={args.k}", f"resources.batch_size={args.batch}"]
    models = load_models(load_config(args.config, overrides), torch.device("cpu"))
    if args.only != "noise":
        print("\n".join(acceptance_table(args.config, overrides, models, args)))
    if args.only != "acceptance":
        print("\n".join(noise_table(models, args.repeats)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
