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
from collections.abc import Callable

import numpy as np

from workers.engine.controller import Controller, FixedK, StepRecord
from workers.engine.drafter import Drafter, Row, propose_within
from workers.engine.stats import GenerationStats


def replayable(drafter: Drafter) -> bool:
    """Whether the drafter's proposals depend on the tokens alone (no draft model, no target states)."""
    return drafter.passes_per_token == 0 and not drafter.reads_prompt_states


def replay_fixed_k(drafter: Drafter, prompts: list[list[int]], completions: list[list[int]], k: int,
                   max_new_tokens: int) -> GenerationStats:
    """The stats of a fixed-k run over the given completions (see `replay`)."""
    return replay(drafter, FixedK(k), prompts, completions, max_new_tokens)


def replay(drafter: Drafter, controller: Controller, prompts: list[list[int]], completions: list[list[int]],
           max_new_tokens: int, pass_s: Callable[[int], float] | None = None) -> GenerationStats:
    """The stats of a batch-1 run under `controller` over the given completions, rows one after another in the
    order a generator admits them, shortest prompt first (a job-wide drafter sees each earlier row's completion,
    as it sees rows that retired before). As in the generator, a step offered nothing still takes the drafter's
    free one-token guess for the controller to learn from. draft_s is the time the drafter spent proposing,
    controller_s the controller's own; with `pass_s` (seconds of a pass of a given width), verify_s is the
    passes' modelled time, which the controller also observes as each pass's cost."""
    stats = GenerationStats(max_k=getattr(controller, "max_k", getattr(controller, "k", 0)))
    longest = max((len(p) + len(c) for p, c in zip(prompts, completions)), default=0)
    drafter.start(1, longest + stats.max_k + 2)
    for prompt, completion in sorted(zip(prompts, completions), key=lambda pair: len(pair[0])):
        row = Row(list(prompt), len(prompt), seed=0)
        drafter.admit([row], 0, None)
        controller.admit(0, 1)
        while row.generated < len(completion):
            t, budget = row.generated, max(0, max_new_tokens - row.generated - 1)
            began = time.perf_counter()
            offer = min(int(controller.choose(1)[0]), budget)
            tried = offer or min(1, budget)   # offered nothing: the free one-token guess
            chosen = time.perf_counter()
            proposal = propose_within(drafter, controller.draft_stop() if offer else None, [row], tried, [tried])
            proposed = time.perf_counter()
            draft = proposal.tokens[0, : int(proposal.lengths[0])].tolist()
            accepted = next((j for j, token in enumerate(draft)
                             if t + j >= len(completion) or token != completion[t + j]), len(draft))
            width = 1 + len(draft) if offer else 1
            seconds = pass_s(width) if pass_s else 0.0
            confidence = None if proposal.confidence is None else proposal.confidence.numpy()
            controller.observe(StepRecord(np.array([tried]), np.array([len(draft)]), np.array([accepted]), width,
                                          proposed - chosen, seconds, confidence))
            stats.controller_s += chosen - began + time.perf_counter() - proposed
            stats.draft_s += proposed - chosen if offer else 0.0
            stats.verify_s += seconds
            stats.record(width - 1, [width - 1], [accepted if offer else 0])
            gained = min((accepted if offer else 0) + 1, len(completion) - t)
            row.tokens.extend(completion[t : t + gained])
            stats.generated_tokens += gained
        drafter.retire(row)
    return stats
