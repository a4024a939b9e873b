"""`make gpu-check` (python -m jobs.gpu_check): the checks that need a GPU, in one run of a few minutes.

Weights are random, built on the device from a shape in configs/shapes (a GPU machine may have no model
files and no network); what is checked does not depend on them:
1. exactness: in fp64, with the captured step (CUDA graphs) and eagerly, every row of our generator (k = 0,
   a drafter of known acceptance at k = 4, n-gram at k = 4; batch 1 and 16) equals transformers' greedy
   `generate` of the same prompt at batch 1;
2. decoding speed: SmolLM2-135M-shaped in bf16, tokens/s at k = 0 by batch size, captured against eager
   and against transformers' `generate`;
3. pass costs: ms per target pass by rows x width for a Llama-3-8B-shaped target in bf16, captured and
   eager, against the floor of reading its weights and KV once (read bandwidth measured here): the
   verify-cost curve the cost model prices speculation with.
Exit status 0 when every row matched, 1 otherwise; results land in OUT/gpu-check.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

from jobs.bench.roofline import kv_bytes_per_token, measure_bandwidth, weight_bytes
from jobs.bench.timing import timed
from tests.tiny_models import OracleDrafter, StubTokenizer
from workers.engine.cached_lm import CachedLM
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import NoDrafter
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.ngram_drafter import NgramDrafter

SHAPES = Path(__file__).resolve().parent.parent / "configs" / "shapes"
STEPS = ("captured", "eager")


def random_target(shape: str | dict, dtype: torch.dtype, device: torch.device, seed: int = 0) -> PreTrainedModel:
    """A model of `shape` (configs/shapes/NAME.json, or a config dict) with random weights, made on the device."""
    fields = shape if isinstance(shape, dict) else json.loads((SHAPES / f"{shape}.json").read_text())
    config = AutoConfig.for_model(**fields)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def random_prompts(n: int, vocab: int, seed: int, shortest: int = 16, longest: int = 160) -> list[list[int]]:
    """Prompts of mixed lengths, each repeating a span of itself so that an n-gram drafter finds matches."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        length = int(torch.randint(shortest, longest, (1,), generator=g))
        head = torch.randint(3, vocab, (length,), generator=g).tolist()
        out.append(head + head[: length // 3])
    return out


def hf_greedy(model: PreTrainedModel, prompt: list[int], max_new: int) -> list[int]:
    ids = torch.tensor([prompt], device=model.device)
    out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, max_new_tokens=max_new,
                         min_new_tokens=max_new, pad_token_id=0, eos_token_id=None)
    return out[0, len(prompt):].tolist()


def generate(model: DecodingModel, prompts: list[list[int]], drafter, k: int, batch: int, max_new: int):
    settings = GenerationSettings(max_new_tokens=max_new, max_k=max(k, 1), batch_size=batch)
    generator = SpeculativeGenerator(model, StubTokenizer(), drafter, FixedK(k), settings)
    return generator.generate([Request(str(i), p, i) for i, p in enumerate(prompts)])


def exactness(device: torch.device, rows: int, max_new: int, shape: str | dict = "smollm2-135m") -> list[dict]:
    model = random_target(shape, torch.float64, device)
    prompts = random_prompts(rows, model.config.vocab_size, seed=1)
    references = [hf_greedy(model, p, max_new) for p in prompts]
    by_prompt = {tuple(p): r for p, r in zip(prompts, references)}
    drafters = {"none k=0": (lambda: NoDrafter(), 0), "oracle(0.7) k=4": (lambda: OracleDrafter(
        by_prompt, 0.7, model.config.vocab_size), 4), "ngram k=4": (lambda: NgramDrafter(3), 4)}
    out = []
    for step in STEPS:
        prepared = DecodingModel.prepare(model, step=step)
        for name, (make, k) in drafters.items():
            for batch in (1, 16):
                got = [c.token_ids for c in generate(prepared, prompts, make(), k, batch, max_new).completions]
                out.append({"step": step, "drafter": name, "batch": batch, "rows": rows,
                            "equal": sum(g == r for g, r in zip(got, references))})
                print(f"exactness {step} {name} batch {batch}: {out[-1]['equal']}/{rows} equal", flush=True)
    return out


def decoding_speed(device: torch.device, batches: list[int], max_new: int,
                   shape: str | dict = "smollm2-135m") -> list[dict]:
    model = random_target(shape, torch.bfloat16, device)
    prompts = random_prompts(max(batches), model.config.vocab_size, seed=2)
    out = []
    for batch in batches:
        chosen = prompts[:batch]
        row = {"batch": batch}
        for step in STEPS:
            prepared = DecodingModel.prepare(model, step=step)
            generate(prepared, chosen, NoDrafter(), 0, batch, 8)   # warm-up: captures, allocator
            result, seconds = timed(device, lambda: generate(prepared, chosen, NoDrafter(), 0, batch, max_new))
            row[f"{step}_tok_s"] = result.stats.generated_tokens / seconds
        ids = torch.tensor(chosen[:1] * batch, device=device)  # transformers pads; equal lengths keep it fair
        hf_greedy(model, chosen[0], 8)
        _, seconds = timed(device, lambda: model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                                          max_new_tokens=max_new, min_new_tokens=max_new,
                                                          pad_token_id=0, eos_token_id=None))
        row["transformers_tok_s"] = batch * max_new / seconds
        out.append(row)
        print(f"speed batch {batch}: " + ", ".join(f"{k} {v:.0f}" for k, v in row.items() if k != "batch"), flush=True)
    return out


def pass_costs(device: torch.device, shape: str | dict, batches: list[int], widths: list[int], context: int,
               repeats: int) -> list[dict]:
    model = random_target(shape, torch.bfloat16, device)
    bandwidth = measure_bandwidth(device)
    weights, kv = weight_bytes(model), kv_bytes_per_token(model.config, model.dtype)
    prompts = random_prompts(max(batches), model.config.vocab_size, seed=3, shortest=context, longest=context + 1)
    out = []
    for step in STEPS:
        prepared = DecodingModel.prepare(model, step=step)
        for batch in batches:
            lm = CachedLM(prepared, batch, max(len(q) for q in prompts) + max(widths) + 2)
            lm.prefill(prompts[:batch], 0)
            for width in widths:
                tokens = torch.ones(batch, width, dtype=torch.long)
                run = lambda: prepared.logits(lm.forward(tokens)[:, -1])   # noqa: E731  same pass each repeat
                run()
                ms = 1e3 * statistics.median(timed(device, run)[1] for _ in range(repeats))
                floor = 1e3 * (weights + kv * batch * (context + width)) / bandwidth
                out.append({"shape": shape if isinstance(shape, str) else "custom", "step": step, "batch": batch, "width": width, "ms": ms, "floor_ms": floor})
                print(f"pass {shape} {step} b={batch} w={width}: {ms:.2f} ms (floor {floor:.2f})", flush=True)
            del lm
            torch.cuda.empty_cache() if device.type == "cuda" else None
    return out


def markdown(result: dict) -> str:
    lines = [f"# gpu-check on {result['device']}", "", "## Exactness (fp64, random SmolLM2-135M-shaped weights)", "",
             "| step | drafter | batch | rows equal to transformers |", "|---|---|---|---|"]
    lines += [f"| {r['step']} | {r['drafter']} | {r['batch']} | {r['equal']}/{r['rows']} |" for r in result["exactness"]]
    lines += ["", "## Decoding, k = 0, bf16 SmolLM2-135M-shaped: tokens/s", "",
              "| batch | captured | eager | transformers | captured / eager |", "|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['captured_tok_s']:.0f} | {r['eager_tok_s']:.0f} | {r['transformers_tok_s']:.0f} | "
              f"{r['captured_tok_s'] / r['eager_tok_s']:.2f} |" for r in result["speed"]]
    lines += ["", f"## Pass cost, bf16 {result['shape']}-shaped: ms per pass (floor: weights + KV read once)", "",
              "| step | batch | width | ms | floor ms | x width 1 |", "|---|---|---|---|---|---|"]
    first = {(r["step"], r["batch"]): r["ms"] for r in result["passes"] if r["width"] == 1}
    lines += [f"| {r['step']} | {r['batch']} | {r['width']} | {r['ms']:.2f} | {r['floor_ms']:.2f} | "
              f"{r['ms'] / first[(r['step'], r['batch'])]:.2f} |" for r in result["passes"]]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m jobs.gpu_check", description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="gpu-out")
    p.add_argument("--device", default="cuda", help="cuda; cpu only to try the script itself (with --quick)")
    p.add_argument("--quick", action="store_true", help="a few rows and shapes: to try the script")
    p.add_argument("--shape", default="llama-3-8b", help="configs/shapes/NAME.json for the pass costs")
    args = p.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print("gpu-check: torch sees no CUDA device", file=sys.stderr)
        return 2
    quick = args.quick
    result = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "shape": args.shape,
              "exactness": exactness(device, 4 if quick else 24, 8 if quick else 32),
              "speed": decoding_speed(device, [1, 4] if quick else [1, 16, 64, 128], 8 if quick else 64),
              "passes": pass_costs(device, "smollm2-135m" if quick else args.shape, [1, 2] if quick else [1, 8, 32, 64, 128],
                                   [1, 4] if quick else [1, 2, 4, 8, 16], 32 if quick else 512, 2 if quick else 10)}
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu-check.json").write_text(json.dumps(result, indent=1))
    (out / "gpu-check.md").write_text(markdown(result))
    print(markdown(result))
    different = [r for r in result["exactness"] if r["equal"] != r["rows"]]
    print("gpu-check: " + ("every row equal to transformers' greedy output" if not different
                           else f"{len(different)} cells DIFFER from transformers' greedy output"), file=sys.stderr)
    return 1 if different else 0


if __name__ == "__main__":
    sys.exit(main())
