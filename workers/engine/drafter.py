"""The drafter interface: cheap guesses of the target's next tokens.

A drafter sees the generator's live rows (slots 0..n-1, each with its tokens so far) and proposes
up to k tokens per row. The `LiveBatch` calls every hook in step with the target's cache; a drafter
overrides only the hooks it needs (the base class's are no-ops).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from workers.engine.draft_stop import DraftStop


@dataclass
class Row:
    """A live row as drafters see it: the tokens so far (prompt + generated), its sampling seed, and its
    own speculation counters (they go into the output row)."""
    tokens: list[int]
    prompt_len: int
    seed: int
    target_passes: int = 0
    drafted: int = 0
    accepted: int = 0
    logprobs: list[float] = field(default_factory=list)                    # per generated token, when asked
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Proposal:
    tokens: torch.Tensor                 # (n, k) long; entries past a row's length are padding
    lengths: torch.Tensor                # (n,) long: drafts proposed per row (0..k)
    probs: torch.Tensor | None = None    # (n, k, vocab) when drafts were sampled from a distribution
    confidence: torch.Tensor | None = None  # (n, k): the drafter's probability of each draft, when it knows it
    passes: int | None = None            # draft forward passes taken, when not passes_per_token * k
    source: torch.Tensor | None = None   # (n,) long: which of a composed drafter's parts served each row (-1: none)


def pack(drafts: list[list[int]], k: int) -> Proposal:
    """Pad per-row draft lists into a Proposal."""
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    tokens = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long).view(len(drafts), k)
    return Proposal(tokens, lengths)


# What the adaptive controller expects of a drafter before it has seen one draft: (reach by position),
# (accept by position), positions past the last listed taking the last (workers/engine/acceptance.py).
# Position 1 is the pooled acceptance of prompt lookup at position 1 over the workload suite's tune half
# (0.12-0.61 by category). A copying drafter (n-gram, suffix) that matched position 1 usually goes on, and
# the target accepts the span's next tokens far more often than its first: the tune half's pooled
# conditional acceptance at positions 2-8 is 0.8-1.0, hence COPY_PRIOR's 0.8.
DEFAULT_PRIOR = ((0.6,), (0.35,))
COPY_PRIOR = ((0.6, 0.95), (0.35, 0.8))


class Drafter:
    """Base class. `propose` is the one method every drafter has; the rest keep per-slot state in step."""

    name = "none"
    passes_per_token = 0  # draft forward passes per proposed token (1 for a draft model, 0 model-free)
    reads_prompt_states = False  # whether admit() needs the target's hidden state at every prompt position
    acceptance_prior = DEFAULT_PRIOR

    def start(self, max_rows: int, capacity: int) -> None:
        """A generate() call begins with room for `max_rows` rows of up to `capacity` tokens."""

    def admit(self, rows: list[Row], start: int, hidden: torch.Tensor | None) -> None:
        """Rows enter slots start..; `hidden` (n, longest prompt - 1, d) holds the target's final hidden
        states over each prompt but its last token (padding past a row's length), or None."""

    def verified(self, rows: list[Row], hidden: torch.Tensor, accepted: torch.Tensor) -> None:
        """After a verify pass: the target's final hidden states (n, width, d) of the tokens it was fed
        (each row's last token, then its drafts) and the drafts accepted per row (n,). Called before the
        verified tokens are appended to the rows."""

    def move(self, src: int, dst: int) -> None:
        """The row in slot `src` now lives in slot `dst` (a finished row's slot is reused)."""

    def retire(self, row: Row) -> None:
        """A row finished; a drafter that learns from the job's outputs reads it here."""

    def limit(self, stop: DraftStop | None) -> None:
        """Before each `propose`: the confidence stop the next proposal may end at. A drafter that drafts
        position by position and knows its confidence stops early (saving passes); others report
        `confidence` and the generator cuts their drafts after the fact."""

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        """Up to min(k, caps[i]) draft tokens for each row."""
        raise NotImplementedError


def propose_within(drafter: Drafter, stop: DraftStop | None, rows: list[Row], k: int, caps: list[int]) -> Proposal:
    """The drafter's proposal, ended at the confidence stop: a drafter that drafts position by position ends
    itself (`limit`), one that reports its confidence is cut after the fact."""
    drafter.limit(stop)
    proposal = drafter.propose(rows, k, caps)
    if stop is not None and proposal.confidence is not None:
        proposal.lengths = stop.cut(proposal.confidence, proposal.lengths)
    return proposal


class NoDrafter(Drafter):
    """Plain decoding: proposes nothing."""

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        return pack([[] for _ in rows], 0)
