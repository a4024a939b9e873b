"""Drafters that compose: per row, the first drafter in the list with a proposal drafts.

List cheap, confident drafters first ([suffix, ngram], [suffix, model]): a drafter that is not sure
proposes nothing for a row and the next one gets it. Every drafter hears every admit, move and
retire, so stateful ones stay in step. A later drafter proposes for all rows at once (a batched
model cannot cheaply do fewer) with a cap of 0 for rows already served, and is not asked at all when
every row is served; a model drafter catches up on the tokens it missed the next time it is asked.
Each row's `source` says which drafter served it, so acceptance can be measured per drafter.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from workers.drafters import Drafter, Proposal, Row


@dataclass
class ComposedProposal(Proposal):
    source: torch.Tensor | None = None   # (n,) long: index of the drafter that served each row, -1 for none


class ComposedDrafter:
    def __init__(self, drafters: list[Drafter]):
        if not drafters:
            raise ValueError("a composed drafter needs at least one drafter")
        self.drafters = drafters
        # Upper bound: a model drafter is skipped on steps where earlier drafters served every row.
        self.passes_per_token = max(d.passes_per_token for d in drafters)

    def start(self, max_rows: int, capacity: int) -> None:
        for d in self.drafters:
            d.start(max_rows, capacity)

    def admit(self, rows: list[Row], start: int) -> None:
        for d in self.drafters:
            d.admit(rows, start)

    def move(self, src: int, dst: int) -> None:
        for d in self.drafters:
            d.move(src, dst)

    def retire(self, slot: int, row: Row) -> None:
        for d in self.drafters:
            if hasattr(d, "retire"):
                d.retire(slot, row)

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> ComposedProposal:
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
            width = p.tokens.shape[1]
            tokens[take, :width] = p.tokens[take]
            lengths[take] = p.lengths[take].clamp(max=cap[take])
            source[take] = i
            served.append((p, take))
        return ComposedProposal(tokens, lengths, _probs(tokens, served), source)


def _probs(tokens: torch.Tensor, served: list[tuple[Proposal, torch.Tensor]]) -> torch.Tensor | None:
    """Draft distributions when a sampling drafter served some row: its rows keep theirs, rows of
    one-hot drafters get one-hot distributions (speculative sampling's rule for a deterministic draft;
    exact in distribution, though such a row's sample then differs from the target's own)."""
    sampled = [(p.probs, take) for p, take in served if p.probs is not None and bool(take.any())]
    if not sampled:
        return None
    first = sampled[0][0]
    probs = torch.zeros(*tokens.shape, first.shape[-1], dtype=first.dtype, device=first.device)
    probs.scatter_(-1, tokens.to(first.device).unsqueeze(-1), 1.0)
    for q, take in sampled:
        probs[take.to(q.device), : q.shape[1]] = q[take.to(q.device)]
    return probs
