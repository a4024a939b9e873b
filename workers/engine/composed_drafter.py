"""Drafters that compose: per row, the first drafter in the list with a proposal drafts.

List confident drafters first ([suffix, ngram], [suffix, model]): a drafter that is not sure proposes
nothing for a row and the next one gets it. Every drafter hears every hook, so stateful ones stay in
step. A later drafter proposes for all rows at once (a batched model cannot cheaply do fewer), with a
cap of 0 for rows already served, and is not asked at all when every row is served; a model drafter
catches up on the tokens it missed the next time it is asked. Each row's `source` in the proposal
names the drafter that served it, so acceptance is measured per drafter.
"""
from __future__ import annotations

import torch

from workers.engine.draft_stop import DraftStop
from workers.engine.drafter import Drafter, Proposal, Row


class ComposedDrafter(Drafter):
    def __init__(self, drafters: list[Drafter]):
        if not drafters:
            raise ValueError("a composed drafter needs at least one drafter")
        self.drafters = drafters
        self.name = "+".join(d.name for d in drafters)
        # An upper bound: a model drafter is skipped on steps where earlier drafters served every row.
        self.passes_per_token = max(d.passes_per_token for d in drafters)
        self.reads_prompt_states = any(d.reads_prompt_states for d in drafters)
        self.acceptance_prior = drafters[0].acceptance_prior  # the part that serves first

    def start(self, max_rows: int, capacity: int) -> None:
        for d in self.drafters:
            d.start(max_rows, capacity)

    def admit(self, rows: list[Row], start: int, hidden: torch.Tensor | None) -> None:
        for d in self.drafters:
            d.admit(rows, start, hidden)

    def verified(self, rows: list[Row], hidden: torch.Tensor, accepted: torch.Tensor) -> None:
        for d in self.drafters:
            d.verified(rows, hidden, accepted)

    def limit(self, stop: DraftStop | None) -> None:
        for d in self.drafters:
            d.limit(stop)

    def move(self, src: int, dst: int) -> None:
        for d in self.drafters:
            d.move(src, dst)

    def retire(self, row: Row) -> None:
        for d in self.drafters:
            d.retire(row)

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        n = len(rows)
        tokens = torch.zeros(n, k, dtype=torch.long)
        lengths = torch.zeros(n, dtype=torch.long)
        source = torch.full((n,), -1, dtype=torch.long)
        cap = torch.tensor(caps, dtype=torch.long).view(n)
        served: list[tuple[Proposal, torch.Tensor]] = []
        for i, drafter in enumerate(self.drafters):
            open_caps = torch.where(source < 0, cap, 0)
            if not bool((open_caps > 0).any()):
                break
            p = drafter.propose(rows, k, open_caps.tolist())
            take = (source < 0) & (p.lengths.clamp(max=open_caps) > 0)
            tokens[take, : p.tokens.shape[1]] = p.tokens[take]
            lengths[take] = p.lengths[take].clamp(max=cap[take])
            source[take] = i
            served.append((p, take))
        return Proposal(tokens, lengths, _probs(tokens, served), _confidence(k, served), source=source)


def _confidence(k: int, served: list[tuple[Proposal, torch.Tensor]]) -> torch.Tensor | None:
    """Per-draft confidence when a part that reports it served some row; NaN (unknown) for rows of parts that do
    not: the confidence stop keeps those as proposed (such a part ends its drafts by its own measure) and the
    controller's calibration leaves them out."""
    known = [(p.confidence, take) for p, take in served if p.confidence is not None and bool(take.any())]
    if not known:
        return None
    confidence = torch.full((len(served[0][1]), k), float("nan"), dtype=torch.float64)
    for q, take in known:
        confidence[take, : q.shape[1]] = q[take].double().cpu()
    return confidence


def _probs(tokens: torch.Tensor, served: list[tuple[Proposal, torch.Tensor]]) -> torch.Tensor | None:
    """Draft distributions when a sampling drafter served some row (rejection coupling; invariant drafts carry
    none): its rows keep theirs, rows of one-hot drafters get one-hot distributions (speculative sampling's
    rule for a deterministic draft; exact in distribution, though such a row's sample then differs from the
    target's own)."""
    sampled = [(p.probs, take) for p, take in served if p.probs is not None and bool(take.any())]
    if not sampled:
        return None
    first = sampled[0][0]
    probs = torch.zeros(*tokens.shape, first.shape[-1], dtype=first.dtype, device=first.device)
    probs.scatter_(-1, tokens.to(first.device).unsqueeze(-1), 1.0)
    for q, take in sampled:
        rows = take.to(q.device)
        probs[rows, : q.shape[1]] = q[rows]
    return probs
