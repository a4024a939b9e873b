"""`specbatch plan CONFIG`: a job predicted before it runs, from a pilot on a uniform sample of its input.

The pilot runs the config's own target and drafter over the sample on this machine, which gives what no
formula knows: completion lengths and how often drafts are accepted, per position. Acceptance is measured
as if drafting to max_k on every row (an adaptive pilot would measure deep positions only on the rows it
chose to draft deep, an optimistic sample), so the conditional rate at each position prices every fixed
k; adaptive k is predicted at the best of them, what the controller aims for. A model-free drafter's
drafts are replayed over the completions of a k = 0 pilot (jobs/draft_replay.py: exact, and a fraction
of the compute); a model drafter's pilot drafts to max_k for real.
Pass times come from the same cost model the controller uses: measured here by a short probe (rows x
width, on prompts repeated from the sample, so prefix sharing makes their prefill nearly free), or,
with `--hardware NAME`, the roofline of that accelerator for the target's shape (a simulation, and
labelled so). The job is then replayed shard by shard as a worker runs it: `batch_size` slots, rows
of the sampled lengths admitted as others finish, each pass priced by its live rows and width, so the
drain at the end of every shard is counted too.
"""
from __future__ import annotations

import dataclasses
import json
import math
import statistics
import time
from collections import defaultdict
from dataclasses import dataclass

import torch

from jobs.bench.timing import timed
from jobs.draft_replay import replay_fixed_k, replayable
from pipeline.planner import Plan, plan_job
from workers.config import JobConfig
from workers.engine.cached_lm import CachedLM
from workers.engine.costs import HARDWARE, Shape, load_shape
from workers.engine.drafter import Drafter
from workers.shard_io import InputRow, read_shard
from workers.registry import make_generator
from workers.shard_runner import ShardRunner

BATCH_SIZES = (1, 4, 8, 16, 32, 64)
PROBE_REPEATS = 3


@dataclass
class Pilot:
    """What the sample's requests did under the config's settings."""
    tokens: list[int]               # generated tokens per request
    prompt_tokens: float            # mean per request
    tokens_per_row_pass: float
    accept: list[float]             # conditional acceptance per draft position (nan where never tried)
    overhead_per_row_pass_s: float  # drafting and bookkeeping per row per pass
    prefill_tok_s: float            # prompt tokens per second of prefill, shared prefixes included
    wall_s: float
    groups: dict[str, list[int]]    # category or task -> indexes of its requests
    sequences: list[tuple[list[int], list[int]]]  # (prompt ids, completion ids) per request


def sample_rows(config: JobConfig, plan: Plan, count: int) -> tuple[list[InputRow], list[int]]:
    """`count` rows spread evenly over the input, and the input rows of every shard (counted where read,
    estimated from the read ones elsewhere). A job of at most `count` shards is read whole and sampled
    evenly; a larger one gives one row from each of `count` evenly spaced shards."""
    shards = plan.shards
    whole = len(shards) <= count
    picked = range(len(shards)) if whole else [int(i * len(shards) / count) for i in range(count)]
    read = {i: read_shard(shards[i], config.input, config.output.keep_columns) for i in picked}
    usable = {i: [r for r in rows if r.error is None] for i, rows in read.items()}
    if whole:
        pool = [r for i in picked for r in usable[i]]
        rows = [pool[int(j * len(pool) / count)] for j in range(min(count, len(pool)))]
    else:
        rows = [usable[i][len(usable[i]) // 2] for i in picked if usable[i]]
    mean = sum(len(r) for r in read.values()) / len(read)
    return rows, [s.stop - s.start if s.kind == "parquet" else len(read[i]) if i in read else round(mean)
                  for i, s in enumerate(shards)]


def _group_of(row: InputRow) -> str | None:
    for column in ("category", "task"):
        if row.keep.get(column) is not None:
            return str(row.keep[column])
    return None


def run_pilot(runner: ShardRunner, rows: list[InputRow]) -> Pilot:
    requests, slots = runner.requests(rows)
    started = time.perf_counter()
    result = runner.generator.generate(requests)
    stats = result.stats
    groups: dict[str, list[int]] = defaultdict(list)
    index = 0
    for row, _, _, error in slots:
        if error is None:
            if _group_of(row) is not None:
                groups[_group_of(row)].append(index)
            index += 1
    return Pilot([len(c.token_ids) for c in result.completions], stats.prompt_tokens / max(len(requests), 1),
                 stats.generated_tokens / max(stats.row_passes, 1),
                 stats.accept_by_position,
                 (stats.draft_s + stats.controller_s + stats.other_s) / max(stats.row_passes, 1),
                 stats.prompt_tokens / max(stats.prefill_s, 1e-9), time.perf_counter() - started, dict(groups),
                 [(r.prompt_ids, c.token_ids) for r, c in zip(requests, result.completions)])


def with_replayed_drafts(pilot: Pilot, drafter: Drafter, max_k: int, max_new_tokens: int) -> Pilot:
    """A k = 0 pilot priced as if it had drafted to max_k with `drafter` (model-free: see jobs/draft_replay.py)."""
    started = time.perf_counter()
    stats = replay_fixed_k(drafter, [p for p, _ in pilot.sequences], [c for _, c in pilot.sequences], max_k,
                           max_new_tokens)
    return dataclasses.replace(
        pilot, tokens_per_row_pass=stats.generated_tokens / max(stats.row_passes, 1), accept=stats.accept_by_position,
        overhead_per_row_pass_s=pilot.overhead_per_row_pass_s + stats.draft_s / max(stats.row_passes, 1),
        wall_s=pilot.wall_s + time.perf_counter() - started)


def probe_pass_times(runner: ShardRunner, prompts: list[list[int]], batches: list[int],
                     widths: list[int]) -> dict[tuple[int, int], float]:
    """Seconds per verify pass by (rows, width), measured on this machine over the sample's prompts."""
    target, out = runner.models.target, {}
    for batch in batches:
        chosen = (prompts * batch)[:batch]
        lm = CachedLM(target, batch, max(len(p) for p in chosen) + max(widths) + 2)
        plan = lm.plan(chosen, 0)
        lm.prefill([chosen[i] for i in plan.order], 0, plan)
        for width in widths:
            tokens = torch.ones(batch, width, dtype=torch.long)
            times = [timed(target.device, lambda: target.logits(lm.forward(tokens)[:, -1]))[1]
                     for _ in range(PROBE_REPEATS + 1)]
            out[(batch, width)] = statistics.median(times[1:])   # the first is a warm-up
    return out


def tokens_per_row_pass(accept: list[float], k: int) -> float:
    """Expected tokens per row per pass at fixed k from conditional per-position acceptance (Leviathan et al.:
    1 + sum over j <= k of the product of the first j rates); positions never tried take the last rate seen."""
    rates = [a for a in accept if not math.isnan(a)]
    total, reach = 1.0, 1.0
    for j in range(k):
        reach *= (accept[j] if j < len(accept) and not math.isnan(accept[j]) else (rates[-1] if rates else 0.0))
        total += reach
    return total


class PassTimes:
    """Seconds per pass by (rows, width): probe cells interpolated in rows and width, or a roofline."""

    def __init__(self, cells: dict[tuple[int, int], float] | None = None, roofline=None):
        self.cells, self.roofline = cells or {}, roofline

    def __call__(self, rows: int, width: int) -> float:
        if self.roofline is not None:
            return self.roofline(rows, width)
        batches = sorted({b for b, _ in self.cells})
        widths = sorted({w for _, w in self.cells})
        w = min(max(width, widths[0]), widths[-1])

        def at(batch: int) -> float:
            lo = max([x for x in widths if x <= w])
            hi = min([x for x in widths if x >= w])
            t_lo, t_hi = self.cells[(batch, lo)], self.cells[(batch, hi)]
            return t_lo if hi == lo else t_lo + (t_hi - t_lo) * (w - lo) / (hi - lo)
        if rows <= batches[0]:
            return at(batches[0])
        if rows >= batches[-1]:
            return at(batches[-1]) * rows / batches[-1] if len(batches) == 1 else \
                at(batches[-1]) + (at(batches[-1]) - at(batches[-2])) * (rows - batches[-1]) / (batches[-1] - batches[-2])
        lo = max(b for b in batches if b <= rows)
        hi = min(b for b in batches if b >= rows)
        return at(lo) if hi == lo else at(lo) + (at(hi) - at(lo)) * (rows - lo) / (hi - lo)


def replay(lengths: list[int], shard_rows: list[int], batch: int, per_row_pass: float, width: int,
           pass_s: PassTimes, overhead_per_row_pass_s: float) -> tuple[float, int]:
    """(seconds, passes) a worker spends decoding: each shard fills `batch` slots with rows of the given
    lengths (cycled) and admits a waiting row as one finishes; a pass costs its live rows at `width`."""
    seconds, passes, next_length = 0.0, 0, 0
    for rows in shard_rows:
        left = []
        for _ in range(rows):
            left.append(max(math.ceil(lengths[next_length % len(lengths)] / per_row_pass), 1))
            next_length += 1
        live, waiting = left[:batch], left[batch:]
        while live:
            n = len(live)
            seconds += pass_s(n, width) + overhead_per_row_pass_s * n
            passes += 1
            live = [x - 1 for x in live if x > 1]
            while waiting and len(live) < batch:
                live.append(waiting.pop(0))
    return seconds, passes


def predict(config: JobConfig, plan: Plan, pilot: Pilot, pass_s: PassTimes, workers: int, shard_input_rows: list[int],
            per_row_pass: float, width: int, batch: int | None = None) -> dict:
    """The whole job's generated tokens and generating time from the pilot, drafting `width` - 1 tokens a row
    and keeping `per_row_pass` a pass, at the config's batch size unless told otherwise."""
    samples = config.generation.samples_per_prompt
    batch = batch or config.resources.batch_size
    out_rows = [rows * samples for rows in shard_input_rows]
    generated = statistics.fmean(pilot.tokens) * sum(out_rows) if pilot.tokens else 0.0
    decode_s, passes = replay(pilot.tokens or [1], out_rows, batch, per_row_pass, width, pass_s,
                              pilot.overhead_per_row_pass_s)
    if pass_s.roofline is not None:  # a simulated device prefills a batch of prompts in one wide pass
        rows = max(sum(out_rows), 1)
        prefill_s = math.ceil(rows / batch) * pass_s(min(batch, rows), max(round(pilot.prompt_tokens), 1))
    else:
        prefill_s = pilot.prompt_tokens * sum(out_rows) / pilot.prefill_tok_s
    total_s = decode_s + prefill_s
    per_worker = total_s / max(min(workers, len(plan.shards)), 1)
    return {"output_rows": sum(out_rows), "generated_tokens": round(generated), "target_passes": passes,
            "generating_s": per_worker, "generating_s_one_worker": total_s, "prefill_s": prefill_s,
            "tokens_per_s": generated / total_s if total_s else 0.0, "workers": workers}


def make_plan(config: JobConfig, sample: int | None = None, hardware: str | None = None,
              workers: int | None = None, shape: str | None = None) -> dict:
    """Everything `specbatch plan` prints: the sample, the prediction at the config's settings, the options
    (drafter and k, batch size) with their predicted speed, and the recommended settings. With `hardware`,
    passes are priced by that accelerator's roofline for the target's shape, or for `shape` (a bigger model
    whose acceptance the config's own target stands in for)."""
    started = time.perf_counter()
    shape_name, shape_config = load_shape(shape, hardware) if shape else (None, None)
    plan = plan_job(config)
    runner = ShardRunner(config)
    spec = config.speculation
    max_k = spec.max_k if spec.k == "adaptive" else int(spec.k)
    drafter = runner.generator.drafter
    replay = max_k > 0 and replayable(drafter)
    runner.generator = make_generator(config.model_copy(update={"speculation": spec.model_copy(
        update={"k": 0 if replay else max_k})}), runner.models)
    known = plan.total_rows if plan.total_rows is not None else config.sharding.rows_per_shard * len(plan.shards)
    count = sample or max(8, math.ceil(0.02 * known))
    rows, shard_rows = sample_rows(config, plan, count)
    if not rows:
        raise ValueError(f"{config.input.path}: no usable rows to sample")
    pilot = run_pilot(runner, rows)
    if replay:
        pilot = with_replayed_drafts(pilot, drafter, max_k, config.generation.max_new_tokens)
    workers = workers or (config.resources.workers if isinstance(config.resources.workers, int) else 1)
    batches = sorted({b for b in BATCH_SIZES if b <= max(config.resources.batch_size, 1)} | {config.resources.batch_size})
    widths = sorted({1, 2, 3, 5, max_k + 1})
    if hardware:
        profile = HARDWARE[hardware]
        simulated = Shape.of(shape_config or runner.models.target.config)
        context = pilot.prompt_tokens + statistics.fmean(pilot.tokens) / 2
        pass_s = PassTimes(roofline=lambda n, w: simulated.pass_s(profile, n, w, context))
        batches = sorted(set(BATCH_SIZES + (64, 128, 256)) | {config.resources.batch_size})
    else:
        prompts = [r.prompt_ids for r in runner.requests(rows)[0]]
        pass_s = PassTimes(probe_pass_times(runner, prompts, batches, widths))
    options = []
    for k in range(max_k + 1):
        per = tokens_per_row_pass(pilot.accept, k)
        result = predict(config, plan, pilot, pass_s, workers, shard_rows, per_row_pass=per, width=k + 1)
        options.append({"drafter": "none" if k == 0 else _drafter_name(config), "k": k,
                        "tokens_per_row_pass": per, "generating_s": result["generating_s"]})
    plain = options[0]["generating_s"]
    for option in options:
        option["speedup"] = plain / option["generating_s"] if option["generating_s"] else 0.0
    best = min(options, key=lambda o: o["generating_s"])
    chosen = best if spec.k == "adaptive" else options[max_k]
    predicted = predict(config, plan, pilot, pass_s, workers, shard_rows, per_row_pass=chosen["tokens_per_row_pass"],
                        width=chosen["k"] + 1)
    by_batch = []
    for b in batches:  # each batch size at its own best k: wide passes are nearly free where memory-bound only
        runs = [predict(config, plan, pilot, pass_s, workers, shard_rows, batch=b,
                        per_row_pass=o["tokens_per_row_pass"], width=o["k"] + 1) for o in options]
        i = min(range(len(runs)), key=lambda j: runs[j]["generating_s"])
        by_batch.append({"batch_size": b, "k": options[i]["k"], "generating_s": runs[i]["generating_s"],
                         "tokens_per_s": runs[i]["tokens_per_s"],
                         "speedup_vs_k0": runs[0]["generating_s"] / runs[i]["generating_s"] if runs[i]["generating_s"] else 0.0})
    fastest = min(by_batch, key=lambda r: r["generating_s"])
    recommended = {"model.drafter": "none" if fastest["k"] == 0 else _drafter_name(config),
                   "speculation.k": fastest["k"], "resources.batch_size": fastest["batch_size"],
                   "predicted_speedup_vs_k0": fastest["speedup_vs_k0"]}
    price = config.resources.price_per_worker_hour
    if price is not None:
        predicted["cost"] = price * predicted["generating_s"] * predicted["workers"] / 3600
    return {"config": config.name, "settings": {"k": spec.k, "batch_size": config.resources.batch_size,
                                                "predicted_as_k": chosen["k"]}, "simulated_on": hardware,
            "simulated_shape": shape_name or (config.model.target if hardware else None), "measured_on": str(runner.device) if not hardware else None,
            "sample": {"rows": len(rows), "requests": len(pilot.tokens), "mean_generated_tokens":
                       statistics.fmean(pilot.tokens), "tokens_per_row_pass": pilot.tokens_per_row_pass,
                       "accept_by_position": [None if math.isnan(a) else a for a in pilot.accept],
                       "pilot_s": pilot.wall_s, "drafts": "replayed over a k = 0 pilot" if replay else "drafted"},
            "predicted": predicted, "options": options, "by_batch_size": by_batch, "recommended": recommended,
            "categories": _categories(pilot), "plan_s": time.perf_counter() - started}


def _drafter_name(config: JobConfig) -> str:
    return "+".join(config.model.drafters)


def _categories(pilot: Pilot) -> list[dict]:
    return [{"category": name, "requests": len(idx), "mean_generated_tokens": statistics.fmean(pilot.tokens[i] for i in idx)}
            for name, idx in sorted(pilot.groups.items())]


def describe(result: dict) -> str:
    """The plan as a user reads it in a terminal."""
    p, s, r = result["predicted"], result["sample"], result["recommended"]
    where = (f"SIMULATED for {result['simulated_on']} (roofline model of a {result['simulated_shape']}-shaped target, "
             f"acceptance and lengths measured on the sample with the config's target; a model, not a measurement)"
             if result["simulated_on"] else f"measured on {result['measured_on']}")
    lines = [f"plan for {result['config']}: {where}",
             f"sample: {s['rows']} rows ({s['requests']} requests), {s['mean_generated_tokens']:.1f} tokens each, "
             f"{s['tokens_per_row_pass']:.2f} tokens per row pass; pilot {s['pilot_s']:.1f} s",
             f"predicted: {p['output_rows']} output rows, {p['generated_tokens']} generated tokens, "
             f"{p['generating_s']:.1f} s generating per worker x {p['workers']} worker(s) "
             f"({p['tokens_per_s']:.0f} tokens/s per worker)" + (f", cost {p['cost']:.2f}" if "cost" in p else ""),
             "", "| drafter | k | tokens/row pass | generating s | speed-up vs k=0 |", "|---|---|---|---|---|"]
    lines += [f"| {o['drafter']} | {o['k']} | {o['tokens_per_row_pass']:.2f} | {o['generating_s']:.1f} | {o['speedup']:.2f} |"
              for o in result["options"]]
    lines += ["", "| batch size | best k | generating s | tokens/s | speed-up vs k=0 |", "|---|---|---|---|---|"]
    lines += [f"| {b['batch_size']} | {b['k']} | {b['generating_s']:.1f} | {b['tokens_per_s']:.0f} | {b['speedup_vs_k0']:.2f} |"
              for b in result["by_batch_size"]]
    if result["categories"]:
        lines += ["", "| category | sampled requests | mean tokens |", "|---|---|---|"]
        lines += [f"| {c['category']} | {c['requests']} | {c['mean_generated_tokens']:.1f} |" for c in result["categories"]]
    lines += ["", "recommended: " + ", ".join(f"{k}={v:.2f}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()),
              f"(plan took {result['plan_s']:.1f} s)"]
    return "\n".join(lines)


def to_json(result: dict) -> str:
    return json.dumps(result, indent=2)
