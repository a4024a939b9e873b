"""Long prompts side by side: each system's time to the first token of one fresh prompt of N tokens, which is
its prefill (every prompt token through the model) and one next-token pass. Ours is `CachedLM.prefill` and the
last token's logits, transformers' one forward keeping the last logits, a peer's a one-token `generate`.

Each repeat uses another slice of the suite's token stream, the same one for every system, so that no engine's
prefix cache (vLLM's is on by default) serves a repeat from the one before it; systems are interleaved.
"""
from __future__ import annotations

import statistics
from collections.abc import Callable

import torch

from jobs.bench.config import PrefillBenchConfig
from jobs.bench.fmt import num
from jobs.bench.peers import PeerError, PeerPool
from jobs.bench.timing import timed
from jobs.bench.workloads import Prompt
from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel

OURS, TRANSFORMERS = "specbatch", "transformers"


def long_prompts(workloads: dict[str, list[Prompt]], length: int, count: int) -> list[Prompt]:
    """`count` prompts of `length` tokens, consecutive slices of every workload prompt's ids end to end (cycled
    when the suite holds fewer tokens)."""
    sources = [p for prompts in workloads.values() for p in prompts]
    stream = [t for p in sources for t in p.ids]
    if not stream:
        raise ValueError("the prefill probe needs prompts: the suite's split has none")
    need = length * count
    stream = (stream * -(-need // len(stream)))[:need]
    return [Prompt(sources[0].source, tuple(stream[i * length : (i + 1) * length])) for i in range(count)]


def _ours(target: DecodingModel, ids: list[int]) -> Callable[[], object]:
    lm = CachedLM(target, 1, len(ids) + 1)

    def first_token():
        lm.prefill([ids], 0)
        return lm.logits(torch.tensor([ids[-1:]]))
    return first_token


def _transformers(model: torch.nn.Module, ids: list[int]) -> Callable[[], object]:
    tokens = torch.tensor([ids], device=model.device)
    return lambda: model(input_ids=tokens, use_cache=True, logits_to_keep=1).logits


def probe_long_prefill(cfg: PrefillBenchConfig, target: DecodingModel, workloads: dict[str, list[Prompt]],
                       peers: PeerPool, log: Callable[[str], None]) -> list[dict]:
    """One row per (prompt length, system): seconds to the first token over the repeats, prompt tokens/s, and
    whether every first token equalled transformers' greedy one."""
    device, rows = target.device, []
    for length in cfg.lengths:
        prompts = long_prompts(workloads, length, cfg.repeats + 1)   # the first warms every system up
        systems = [s for s in peers.systems(1) if s.drafter == "none"]
        seconds: dict[str, list[float]] = {OURS: [], TRANSFORMERS: [], **{s.name: [] for s in systems}}
        exact = dict.fromkeys(seconds, True)
        for repeat, prompt in enumerate(prompts):
            ids = list(prompt.ids)
            with torch.inference_mode():
                theirs, their_s = timed(device, _transformers(target.model, ids))
                ours, our_s = timed(device, _ours(target, ids))
            reference = int(theirs[0, -1].argmax())
            firsts, times = {OURS: int(ours[0, -1].argmax()), TRANSFORMERS: reference}, {OURS: our_s, TRANSFORMERS: their_s}
            for system in [s for s in systems if s.peer not in peers.dead]:
                try:
                    run = peers.run(system, [prompt], 1, 1)
                except PeerError as error:
                    peers.fail(system, error)
                    continue
                firsts[system.name], times[system.name] = (run.outputs[0] or [None])[0], run.wall_s
            for name, first in firsts.items():
                exact[name] &= first == reference
                if repeat:
                    seconds[name].append(times[name])
        medians = {name: statistics.median(values) for name, values in seconds.items() if values}
        best_peer = min((s for name, s in medians.items() if name not in (OURS, TRANSFORMERS)), default=None)
        for name, median in medians.items():
            rows.append({"prompt_tokens": length, "system": name, "first_token_s": median, "min_s": min(seconds[name]),
                         "max_s": max(seconds[name]), "tok_s": length / median, "exact": exact[name],
                         "ours_over_best_peer": best_peer / median if name == OURS and best_peer else None})
            log(f"prefill {length} tokens {name}: {rows[-1]['tok_s']:.0f} tok/s")
    return rows


def long_prefill_markdown(rows: list[dict]) -> list[str]:
    """The long-prompt table of results.md."""
    if not rows:
        return []
    lines = ["Long prompts: time to the first token of one fresh prompt at batch 1 (its prefill and one pass), median "
             "of repeats, each repeat a new slice of the suite's tokens, systems interleaved; × best peer: ours over "
             "the fastest peer; exact: every first token equals transformers' greedy one.", "",
             "| prompt tokens | system | first token s (min–max) | prompt tok/s | × best peer | exact |",
             "|---:|---|---|---:|---:|---|"]
    lines += [f"| {r['prompt_tokens']} | {r['system']} | {num(r['first_token_s'], 3)} ({num(r['min_s'], 3)}–"
              f"{num(r['max_s'], 3)}) | {num(r['tok_s'], 0)} | {num(r['ours_over_best_peer'], 2)} | "
              f"{'yes' if r['exact'] else 'NO'} |" for r in rows]
    return lines
