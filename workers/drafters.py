"""Drafters: cheap guesses of the target's next tokens, behind one small interface.

A drafter sees the generator's live rows (slots 0..n-1, each with its tokens so far) and proposes
up to k tokens per row. Stateful drafters hear about admissions and slot moves to stay in sync.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from transformers import PreTrainedModel

from workers.cached_lm import CachedLM
from workers.sampling import SamplingParams, inverse_cdf, probabilities, uniforms


@dataclass
class Row:
    """A live row as drafters see it: the tokens so far (prompt + generated) and its sampling seed."""
    tokens: list[int]
    prompt_len: int
    seed: int

    @property
    def generated(self) -> int:
        return len(self.tokens) - self.prompt_len


@dataclass
class Proposal:
    tokens: torch.Tensor                 # (n, k) long; entries past a row's length are padding
    lengths: torch.Tensor                # (n,) long: drafts proposed per row (0..k)
    probs: torch.Tensor | None = None    # (n, k, vocab) when drafts were sampled from a distribution


class Drafter(Protocol):
    passes_per_token: int  # draft forward passes per proposed token (1 for a draft model, 0 model-free)

    def start(self, max_rows: int, capacity: int) -> None: ...
    def admit(self, rows: list[Row], start: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...
    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal: ...


def pack(drafts: list[list[int]], k: int) -> Proposal:
    """Pad per-row draft lists into a Proposal."""
    lengths = torch.tensor([len(d) for d in drafts], dtype=torch.long)
    tokens = torch.tensor([d + [0] * (k - len(d)) for d in drafts], dtype=torch.long).view(len(drafts), k)
    return Proposal(tokens, lengths)


class NoDrafter:
    """Plain decoding: proposes nothing."""
    passes_per_token = 0

    def start(self, max_rows: int, capacity: int) -> None: ...
    def admit(self, rows: list[Row], start: int) -> None: ...
    def move(self, src: int, dst: int) -> None: ...

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        return pack([[] for _ in rows], 0)


@dataclass
class _NgramIndex:
    """Latest end position of every n-gram (n <= size) of one row, indexed incrementally."""
    size: int
    last_end: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int], upto: int) -> None:
        for end in range(self.indexed, upto):
            for n in range(1, min(self.size, end + 1) + 1):
                self.last_end[tuple(tokens[end - n + 1 : end + 1])] = end
        self.indexed = max(self.indexed, upto)


class NgramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the row's last n tokens (longest n first)
    in its prompt and output so far, and propose what followed it. Model-free; costs microseconds."""
    passes_per_token = 0

    def __init__(self, ngram_size: int = 3):
        self.ngram_size = ngram_size
        self.indexes: list[_NgramIndex] = []

    def start(self, max_rows: int, capacity: int) -> None:
        self.indexes = [_NgramIndex(self.ngram_size) for _ in range(max_rows)]

    def admit(self, rows: list[Row], start: int) -> None:
        for slot in range(start, start + len(rows)):
            self.indexes[slot] = _NgramIndex(self.ngram_size)

    def move(self, src: int, dst: int) -> None:
        self.indexes[dst] = self.indexes[src]

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        drafts = []
        for slot, (row, cap) in enumerate(zip(rows, caps)):
            tokens, index = row.tokens, self.indexes[slot]
            index.extend(tokens, len(tokens) - 1)  # never match the suffix with itself
            found: list[int] = []
            for n in range(min(self.ngram_size, len(tokens) - 1), 0, -1):
                end = index.last_end.get(tuple(tokens[-n:]))
                if end is not None:
                    found = tokens[end + 1 : end + 1 + min(k, cap)]
                    break
            drafts.append(found)
        return pack(drafts, k)


class ModelDrafter:
    """A small causal LM sharing the target's tokenizer, batched, with its own slot KV cache.

    After a verify step only the accepted drafts stay valid in its cache; it finds them by comparing
    what it fed with the row's tokens, so the generator never has to tell it what was accepted.
    """

    def __init__(self, model: PreTrainedModel, sampling: SamplingParams):
        self.model, self.sampling = model, sampling
        self.lm: CachedLM | None = None
        self.fed: list[list[int]] = []  # per slot: every token in the draft cache, in order
        self.passes_per_token = 1

    def start(self, max_rows: int, capacity: int) -> None:
        self.lm = CachedLM(self.model, max_rows, capacity)
        self.fed = [[] for _ in range(max_rows)]

    def admit(self, rows: list[Row], start: int) -> None:
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
        logits = self.lm.forward(batch)
        last = torch.tensor([len(p) - 1 for p in pending])
        self.lm.advance(last + 1)
        for slot, p in enumerate(pending):
            self.fed[slot] = self.fed[slot] + p
        return logits[torch.arange(len(rows)), last.to(logits.device)]

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        logits = self._catch_up(rows)
        seeds, starts = [r.seed for r in rows], [r.generated for r in rows]
        drafts, probs = [], []
        for j in range(k):
            if self.sampling.greedy:
                token = logits.argmax(-1)
            else:
                p = probabilities(logits, self.sampling)
                token = inverse_cdf(p, uniforms(seeds, [s + j for s in starts], 1, stream=2).squeeze(1))
                probs.append(p)
            drafts.append(token.cpu())
            if j + 1 < k:
                logits = self.lm.forward(token.view(-1, 1).cpu())[:, 0]
                self.lm.advance(torch.ones(len(rows), dtype=torch.long))
                for slot, t in enumerate(token.tolist()):
                    self.fed[slot].append(t)
        tokens = torch.stack(drafts, 1) if drafts else torch.zeros(len(rows), 0, dtype=torch.long)
        lengths = torch.tensor([min(k, c) for c in caps], dtype=torch.long)
        return Proposal(tokens, lengths, torch.stack(probs, 1) if probs else None)
