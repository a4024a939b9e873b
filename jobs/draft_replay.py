"""A model-free drafter's acceptance, measured without a single wide pass: replayed over known completions.

A model-free drafter (n-gram, suffix, or a list of them) proposes from the tokens so far alone, and a
one-hot draft is accepted exactly while it equals the tokens the target then picks: greedy, and sampled
under either coupling (workers/engine/sampling.py). So once a pilot has generated a sample's completions
at k = 0, a run at fixed k over them can be replayed here: propose at each pass start, accept the matching
prefix, move on by the accepted tokens + 1, and count per position as a run's own stats do. That prices
every k for the cost of a k = 0 pilot, where drafting to max_k for real costs up to max_k + 1 times the
target's compute in every pass (`specbatch plan`).
"""
from __future__ import annotations

import time

from workers.engine.drafter import Drafter, Row
from workers.engine.stats import GenerationStats


def replayable(drafter: Drafter) -> bool:
    """Whether the drafter's proposals depend on the tokens alone (no draft model, no target states)."""
    return drafter.passes_per_token == 0 and not drafter.reads_prompt_states


def replay_fixed_k(drafter: Drafter, prompts: list[list[int]], completions: list[list[int]], k: int,
                   max_new_tokens: int) -> GenerationStats:
    """The stats of a fixed-k run over the given completions, rows one after another in the order a generator
    admits them, shortest prompt first (a job-wide drafter sees each earlier row's completion, as it sees
    rows that retired before); draft_s is the time the drafter spent proposing."""
    stats = GenerationStats(max_k=k)
    longest = max((len(p) + len(c) for p, c in zip(prompts, completions)), default=0)
    drafter.start(1, longest + k + 2)
    for prompt, completion in sorted(zip(prompts, completions), key=lambda pair: len(pair[0])):
        row = Row(list(prompt), len(prompt), seed=0)
        drafter.admit([row], 0, None)
        while row.generated < len(completion):
            t = row.generated
            began = time.perf_counter()
            proposal = drafter.propose([row], k, [max(0, min(k, max_new_tokens - t - 1))])
            stats.draft_s += time.perf_counter() - began
            draft = proposal.tokens[0, : int(proposal.lengths[0])].tolist()
            accepted = next((j for j, token in enumerate(draft) if t + j >= len(completion) or token != completion[t + j]),
                            len(draft))
            stats.record(len(draft), [len(draft)], [accepted])
            gained = min(accepted + 1, len(completion) - t)
            row.tokens.extend(completion[t : t + gained])
            stats.generated_tokens += gained
        drafter.retire(row)
    return stats
