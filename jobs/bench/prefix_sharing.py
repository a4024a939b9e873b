"""`python -m jobs.bench.prefix_sharing`: what prefill costs when rows share a prefix, with and without sharing.

A synthetic-data shape: N prompts from the suite's report half behind one long shared instruction, each
asked for S samples. The job's prefill time with S samples is compared with the 1-sample job's (the goal:
at most 2x for S = 8), with prefix sharing on and off (off: what a drafter that reads every prompt state
gets), in interleaved repeats. Generation is one token a row, so prefill is what is timed.
"""
from __future__ import annotations

import argparse
import statistics

import torch

from jobs.suite import load_suite
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import NoDrafter
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.sampling import SamplingParams
from workers.models import load_model, load_tokenizer

INSTRUCTION = ("You are a careful assistant writing training data. Follow the style guide: answer in plain English, "
               "keep every fact from the input, never invent names, numbers or dates, prefer short sentences, use "
               "lists only when the input has several parallel items, write code in fenced blocks with the language "
               "named, and end with a one-line summary that starts with 'In short:'. Vary your wording between "
               "answers so that no two samples read alike, but keep the content identical. ") * 2


class _Unshared(NoDrafter):
    reads_prompt_states = True   # as the MTP drafter: every prompt token is computed


def prefill_s(target: DecodingModel, tokenizer, prompts: list[list[int]], samples: int, shared: bool) -> float:
    settings = GenerationSettings(max_new_tokens=1, batch_size=len(prompts) * samples,
                                  sampling=SamplingParams(temperature=0.8))
    generator = SpeculativeGenerator(target, tokenizer, NoDrafter() if shared else _Unshared(), FixedK(0), settings)
    requests = [Request(f"{i}/{s}", p, seed=s) for i, p in enumerate(prompts) for s in range(samples)]
    return generator.generate(requests).stats.prefill_s


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.bench.prefix_sharing", description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="demo:smollm2")
    p.add_argument("--prompts", type=int, default=12)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--repeats", type=int, default=3)
    args = p.parse_args(argv)
    torch.set_num_threads(torch.get_num_threads())
    target = DecodingModel.prepare(load_model(args.model, "float32", torch.device("cpu")))
    tokenizer = load_tokenizer(args.model)
    suite = [row for rows in load_suite("report").values() for row in rows if row.prompt][: args.prompts]
    prompts = [tokenizer(INSTRUCTION + "\n\n" + row.prompt)["input_ids"] for row in suite]
    times: dict[tuple[int, bool], list[float]] = {}
    prefill_s(target, tokenizer, prompts[:2], 1, True)   # warm-up
    for _ in range(args.repeats):
        for samples in (1, args.samples):
            for shared in (True, False):
                times.setdefault((samples, shared), []).append(prefill_s(target, tokenizer, prompts, samples, shared))
    tokens = sum(len(p) for p in prompts)
    print(f"{len(prompts)} prompts, {tokens / len(prompts):.0f} tokens each on average (shared instruction "
          f"{len(tokenizer(INSTRUCTION)['input_ids'])} tokens); prefill seconds, median of {args.repeats}:")
    print("| samples | sharing | prefill s | x 1-sample job (sharing on) | prompt tokens/s |")
    print("|---|---|---|---|---|")
    one = statistics.median(times[(1, True)])
    for (samples, shared), values in times.items():
        median = statistics.median(values)
        print(f"| {samples} | {'on' if shared else 'off'} | {median:.2f} | {median / one:.2f} | "
              f"{tokens * samples / median:.0f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
