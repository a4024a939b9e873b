"""Drafting with an MTP head on the target's own hidden states (the head itself: workers/mtp_head.py).

The head's cache holds one entry per position i whose target state h_i and following token t_{i+1} are
both known. Target states arrive with each admission (the prefill's) and each verify pass (those of the
accepted positions); they wait in `pending` until the token after them is known, at the next propose.
Proposing feeds them (the catch-up), then chains the head on its own output k - 1 times; the chained
entries are speculative and the next catch-up overwrites them.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from workers.engine.cached_lm import SlotRows
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import Drafter, Proposal, Row
from workers.engine.fused_decoder import FusedDecoder
from workers.engine.linear import Linear, linear
from workers.engine.sampling import SamplingParams, draft_sample, probabilities

if TYPE_CHECKING:
    from workers.mtp_head import MTPHead


@dataclass
class DraftHead:
    """An MTP head prepared for drafting as DecodingModel prepares the target: its block on the fused decoder and
    its draft LM head laid out for few-row products, with the width-1 kernel the target's measurement chose
    (kernel_choice.py: no GEMV copies where the target kept none). Through transformers' modules and a plain
    matmul a draft step of SmolLM2-135M's head took 6 ms at 1 row and 19 ms at 4 (a fifth to a third of a
    target pass)."""
    head: MTPHead
    proj: Linear
    block: FusedDecoder
    lm_head: Linear

    @classmethod
    def prepare(cls, head: MTPHead, target: DecodingModel) -> DraftHead:
        spec, shared, dtype = head.spec.block, head.shared, head.proj.weight.dtype
        gemv = target.head.few_rows is not None
        block = FusedDecoder(head.layers, heads=spec["num_attention_heads"], kv_heads=spec["num_key_value_heads"],
                             eps=spec["rms_norm_eps"], norm=shared.norm.to(dtype), rotary=head.rotary, gemv=gemv)
        proj = Linear.of(head.proj.weight, gemv=gemv)
        if head.vocab_ids is None and target.dtype == dtype:
            return cls(head, proj, block, target.head)
        bias = shared.head_bias
        if bias is not None:
            bias = (bias if head.vocab_ids is None else bias[head.vocab_ids]).to(dtype)
        return cls(head, proj, block, Linear.of(head.head_rows().to(dtype), bias, gemv))

    def logits(self, states: torch.Tensor) -> torch.Tensor:
        """fp32 logits over the draft vocabulary (index i is token vocab_ids[i])."""
        return linear(states, self.lm_head).float()


class CachedHead(SlotRows):
    """The head over its own slot cache; an entry at position i holds the head's input for (h_i, t_{i+1})."""

    def __init__(self, draft: DraftHead, max_rows: int, capacity: int):
        super().__init__(max_rows, capacity, draft.head.proj.weight.device, draft.head.proj.weight.dtype)
        self.draft = draft

    @torch.inference_mode()
    def forward(self, hidden: torch.Tensor, tokens: torch.Tensor, start: int = 0) -> torch.Tensor:
        """Feed (n, q) entries to slots start..start+n-1; returns the head's states (n, q, d)."""
        positions, mask = self.place(*tokens.shape, start)
        x = self.draft.head.project(hidden.to(self.device), tokens.to(self.device), self.draft.proj)
        return self.draft.block.run(x, positions, mask, self.cache)


class MTPDrafter(Drafter):
    name = "mtp"
    passes_per_token = 1
    reads_prompt_states = True   # the head starts from the target's state at every prompt position

    def __init__(self, target: DecodingModel, head: MTPHead, sampling: SamplingParams):
        self.head, self.sampling = head, sampling
        self.draft = DraftHead.prepare(head, target)
        self.vocab = target.head_weight.shape[1]
        self.lm: CachedHead | None = None
        self.pending: list[list[torch.Tensor]] = []  # per slot: target states not yet in the head's cache

    def start(self, max_rows: int, capacity: int) -> None:
        # A catch-up pads every row to the longest pending run (a new row's whole prompt, under `capacity`), so
        # a row near its end may write padding up to `capacity` entries past it: the head's cache has room.
        self.lm = CachedHead(self.draft, max_rows, 2 * capacity)
        self.pending = [[] for _ in range(max_rows)]

    def admit(self, rows: list[Row], start: int, hidden: torch.Tensor | None) -> None:
        for slot, row in enumerate(rows, start):
            self.pending[slot] = [] if hidden is None else [hidden[slot - start, : len(row.tokens) - 1]]
        self.lm.lengths[start : start + len(rows)] = 0

    def verified(self, rows: list[Row], hidden: torch.Tensor, accepted: torch.Tensor) -> None:
        for slot, n in enumerate(accepted.tolist()):
            self.pending[slot].append(hidden[slot, : n + 1])

    def move(self, src: int, dst: int) -> None:
        self.lm.move(src, dst)
        self.pending[dst] = self.pending[src]

    def _catch_up(self, rows: list[Row]) -> tuple[torch.Tensor, torch.Tensor]:
        """Feed every pending state with the token that followed it; returns the head's state at each row's
        newest entry (n, d), which predicts the row's next token, and whether the row has one (n,)."""
        states, tokens = [], []
        for slot, row in enumerate(rows):
            fed = int(self.lm.lengths[slot])
            states.append(torch.cat(self.pending[slot]) if self.pending[slot] else None)
            self.pending[slot] = []
            tokens.append(row.tokens[fed + 1 :])  # one per pending state: states cover positions fed..len-2
            assert len(tokens[-1]) == (0 if states[-1] is None else len(states[-1])), "head cache out of step"
        counts = torch.tensor([len(t) for t in tokens])
        width = max(1, int(counts.max()))
        d = self.head.spec.hidden_size
        hidden = torch.zeros(len(rows), width, d, dtype=self.lm.dtype, device=self.lm.device)
        for row, state in enumerate(states):
            if state is not None:
                hidden[row, : len(state)] = state
        batch = torch.tensor([t + [0] * (width - len(t)) for t in tokens])
        out = self.lm.forward(hidden, batch)
        self.lm.advance(counts)
        last = (counts - 1).clamp(min=0).to(out.device)
        return out[torch.arange(len(rows), device=out.device), last], counts > 0

    def _choose(self, logits: torch.Tensor, rows: list[Row], j: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The j-th draft token per row, and its full-vocabulary distribution q when the rejection rule needs it
        (0 outside V'). The invariant race reads the noise by full-vocabulary id, as the target's does."""
        if self.sampling.greedy:
            return self.head.to_full_vocab(logits.argmax(-1)), None
        p = probabilities(logits, self.sampling)
        index = draft_sample(p, self.sampling, [r.seed for r in rows], [r.generated + j for r in rows],
                             self.head.vocab_ids)
        if self.sampling.invariant:
            return self.head.to_full_vocab(index), None
        if self.head.vocab_ids is None:
            return index, p
        q = torch.zeros(len(rows), self.vocab, dtype=p.dtype, device=p.device)
        q[:, self.head.vocab_ids] = p
        return self.head.to_full_vocab(index), q

    @torch.inference_mode()
    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        state, ready = self._catch_up(rows)
        real = self.lm.lengths.clone()
        drafts, probs = [], []
        for j in range(k):
            token, q = self._choose(self.draft.logits(state), rows, j)
            drafts.append(token.cpu())
            if q is not None:
                probs.append(q)
            if j + 1 < k:  # chain: the head's own state and its draft make the next entry
                state = self.lm.forward(state[:, None], token[:, None])[:, 0]
                self.lm.advance(torch.ones(len(rows), dtype=torch.long))
        self.lm.lengths = real  # chained entries were speculative: the next catch-up overwrites them
        tokens = torch.stack(drafts, 1) if drafts else torch.zeros(len(rows), 0, dtype=torch.long)
        lengths = torch.tensor([min(k, c) if r else 0 for c, r in zip(caps, ready.tolist())], dtype=torch.long)
        return Proposal(tokens, lengths, torch.stack(probs, 1) if probs else None)
