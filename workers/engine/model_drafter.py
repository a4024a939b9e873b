"""A small causal LM sharing the target's tokenizer, batched, with its own slot KV cache."""
from __future__ import annotations

import torch

from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel
from workers.engine.draft_stop import DraftStop
from workers.engine.drafter import Drafter, Proposal, Row
from workers.engine.sampling import SamplingParams, draft_sample, probabilities


class ModelDrafter(Drafter):
    """After a verify step only the accepted drafts stay valid in its cache; it finds them by comparing
    what it fed with the row's tokens, so the generator never has to tell it what was accepted."""

    name = "model"
    passes_per_token = 1

    def __init__(self, model: DecodingModel, sampling: SamplingParams):
        self.model, self.sampling = model, sampling
        self.lm: CachedLM | None = None
        self.fed: list[list[int]] = []  # per slot: every token in the draft cache, in order
        self.stop: DraftStop | None = None

    def start(self, max_rows: int, capacity: int) -> None:
        self.lm = CachedLM(self.model, max_rows, capacity)
        self.fed = [[] for _ in range(max_rows)]

    def admit(self, rows: list[Row], start: int, hidden=None) -> None:
        self.lm.prefill([r.tokens for r in rows], start)
        for slot, row in enumerate(rows, start):
            self.fed[slot] = row.tokens[:-1]

    def move(self, src: int, dst: int) -> None:
        self.lm.move(src, dst)
        self.fed[dst] = self.fed[src]

    def _catch_up(self, rows: list[Row]) -> torch.Tensor:
        """Roll back to the longest cached prefix of each row, feed the rest; returns next-token logits."""
        pending = []
        for slot, row in enumerate(rows):
            fed, valid = self.fed[slot], 0
            limit = min(len(fed), len(row.tokens) - 1)
            while valid < limit and fed[valid] == row.tokens[valid]:
                valid += 1
            self.fed[slot] = fed[:valid]
            self.lm.lengths[slot] = valid
            pending.append(row.tokens[valid:])
        width = max(len(p) for p in pending)
        batch = torch.tensor([p + [p[-1]] * (width - len(p)) for p in pending])
        last = torch.tensor([len(p) - 1 for p in pending])
        hidden = self.lm.forward(batch)
        self.lm.advance(last + 1)
        for slot, p in enumerate(pending):
            self.fed[slot] = self.fed[slot] + p
        return self.model.logits(hidden[torch.arange(len(rows)), last.to(hidden.device)])

    def limit(self, stop: DraftStop | None) -> None:
        self.stop = stop

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        """Drafts position by position; with a confidence stop, ends as soon as the next column no longer pays."""
        logits = self._catch_up(rows)
        seeds, starts = [r.seed for r in rows], [r.generated for r in rows]
        offered = torch.tensor([min(k, c) for c in caps])
        reach = torch.ones(len(rows), dtype=torch.float64)
        drafts, probs, confidence, passes = [], [], [], 1
        for j in range(k):
            if self.sampling.greedy:
                token = logits.argmax(-1)
                p = logits.float().softmax(-1) if self.stop is not None else None
            else:
                p = probabilities(logits, self.sampling)
                token = draft_sample(p, self.sampling, seeds, [s + j for s in starts])
                if not self.sampling.invariant:  # only the rejection rule reads q
                    probs.append(p)
            if self.stop is not None:
                q = p.gather(-1, token.view(-1, 1)).squeeze(1).cpu()
                reach = self.stop.reach(reach, q)
                if not self.stop.keep(j, reach, offered > j):
                    break
                confidence.append(q)
            drafts.append(token.cpu())
            if j + 1 < k:
                logits = self.lm.logits(token.view(-1, 1).cpu())[:, 0]
                self.lm.advance(torch.ones(len(rows), dtype=torch.long))
                passes += 1
                for slot, t in enumerate(token.tolist()):
                    self.fed[slot].append(t)
        width = len(drafts)
        tokens = torch.stack(drafts, 1) if drafts else torch.zeros(len(rows), 0, dtype=torch.long)
        return Proposal(tokens, offered.clamp(max=width), torch.stack(probs[:width], 1) if width and probs else None,
                        torch.stack(confidence, 1) if confidence else None, passes)
