"""The batched speculative generator: draft up to k tokens per row, verify them all in one target pass.

Each step reads like gpt-fast's speculative_decode, batched: plan (how far each row may draft) ->
draft -> verify -> accept. Live rows sit in the slots of a `LiveBatch`, each with its own cached
length, so rows accept different numbers of tokens per step without padding or recomputation. A row
that finishes leaves at once and a waiting prompt is admitted, keeping the batch full.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch

from workers.engine.cached_lm import CachedLM
from workers.engine.controller import Controller, StepRecord
from workers.engine.decoding_model import DecodingModel
from workers.engine.draft_stop import DraftStop
from workers.engine.drafter import Drafter, Proposal, Row, propose_within
from workers.engine.live_batch import LiveBatch
from workers.engine.sampling import SamplingParams, Verdict, token_logprobs, verify_greedy, verify_sampled
from workers.engine.stats import GenerationStats

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase


@dataclass
class Request:
    id: str
    prompt_ids: list[int]
    seed: int


@dataclass
class Completion:
    token_ids: list[int]
    text: str
    finish_reason: str              # stop | length | error
    error: str | None = None
    prompt_tokens: int = 0
    target_passes: int = 0          # verify passes this row took part in
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    logprobs: list[float] | None = None                    # per token, when GenerationSettings.logprobs is set
    top_logprobs: list[list[tuple[int, float]]] | None = None


@dataclass(kw_only=True)
class GenerationSettings:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    batch_size: int = 16
    max_k: int = 8
    overlong: str = "truncate"      # truncate (keep the prompt's end) | error
    logprobs: int | None = None     # None: none; N: each token's log-probability and the N most likely


@dataclass
class GenerationResult:
    completions: list[Completion]   # in request order
    stats: GenerationStats          # of this call alone
    steps: list[StepRecord] | None = None   # with generate(trace=True): what every step did (not the shadow guesses)


@dataclass
class _Plan:
    offered: list[int]              # per row: positions it may draft, min(its offer, its remaining budget)
    stop: DraftStop | None          # the confidence stop (drafters that report confidence end drafts early)
    shadow: list[int]               # when no row drafts: the free one-token guesses (see _draft)

    @property
    def width(self) -> int:
        """The longest draft allowed: no row drafts further."""
        return max(self.offered, default=0)


def _shadow_step(step: StepRecord, offered: list[int], shadow: Proposal, verdict: Verdict) -> StepRecord:
    """A step in which no row drafted, as the controller sees it: each row's free guess as a one-position
    draft (a row with no guess missed, as when drafting)."""
    lens = shadow.lengths.tolist()
    hits = [int(n > 0 and guess[0] == new[0]) for n, guess, new in zip(lens, shadow.tokens.tolist(), verdict.tokens)]
    return StepRecord(*np.array([offered, lens, hits]), step.width, step.draft_s, step.verify_s)


def eos_ids(generation_config, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    """Every token id that ends a row: the generation config's (one or a list) and the tokenizer's."""
    ids = getattr(generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids


class SpeculativeGenerator:
    def __init__(self, target: DecodingModel, tokenizer: PreTrainedTokenizerBase, drafter: Drafter,
                 controller: Controller, settings: GenerationSettings):
        self.target, self.tokenizer, self.drafter, self.controller = target, tokenizer, drafter, controller
        self.settings = settings
        self.eos = eos_ids(target.model.generation_config, tokenizer)
        self.context = getattr(target.config, "max_position_embeddings", None) or 1 << 30

    def _fit(self, request: Request) -> tuple[list[int] | None, str | None]:
        """Apply the overlong policy: keep the prompt's end, or explain why the row cannot run."""
        budget = self.context - self.settings.max_new_tokens
        ids = request.prompt_ids
        if not ids:
            return None, "prompt is empty after tokenization"
        if len(ids) <= budget:
            return ids, None
        if self.settings.overlong == "truncate" and budget > 0:
            return ids[-budget:], None
        return None, (f"prompt has {len(ids)} tokens; with max_new_tokens={self.settings.max_new_tokens} "
                      f"it exceeds the model context of {self.context} tokens")

    @torch.inference_mode()
    def generate(self, requests: list[Request], trace: bool = False) -> GenerationResult:
        """Complete every request; with `trace`, also return a StepRecord of every step (the bench's traces)."""
        started = time.perf_counter()
        stats, steps = GenerationStats(self.settings.max_k), [] if trace else None
        results: list[Completion | None] = [None] * len(requests)
        runnable = []
        for i, request in enumerate(requests):
            ids, error = self._fit(request)
            if error:
                results[i] = Completion([], "", "error", error, len(request.prompt_ids))
            else:
                runnable.append((i, Request(request.id, ids, request.seed)))
        if runnable:
            self._run(runnable, results, stats, steps)
        stats.other_s = (time.perf_counter() - started - stats.prefill_s - stats.draft_s - stats.verify_s
                         - stats.controller_s)
        return GenerationResult(results, stats, steps)  # type: ignore[arg-type]

    def _run(self, runnable: list[tuple[int, Request]], results: list[Completion | None], stats: GenerationStats,
             steps: list[StepRecord] | None) -> None:
        s = self.settings
        slots = min(s.batch_size, len(runnable))
        capacity = max(len(r.prompt_ids) for _, r in runnable) + s.max_new_tokens + s.max_k + 2
        self.drafter.start(slots, capacity)
        batch = LiveBatch(CachedLM(self.target, slots, capacity), self.drafter, self.controller)
        waiting = deque(sorted(runnable, key=lambda item: len(item[1].prompt_ids)))
        while waiting or batch:
            if waiting and len(batch) < slots:
                started, computed = time.perf_counter(), batch.target.computed_tokens
                admitted = [waiting.popleft() for _ in range(min(slots - len(batch), len(waiting)))]
                batch.admit([(i, Row(list(r.prompt_ids), len(r.prompt_ids), r.seed)) for i, r in admitted])
                stats.prompt_tokens += sum(len(r.prompt_ids) for _, r in admitted)
                seconds = time.perf_counter() - started
                stats.prefill_s += seconds
                self.controller.prefilled(batch.target.computed_tokens - computed, seconds)
            self._step(batch, results, stats, steps, draining=not waiting)
        stats.prefilled_tokens = batch.target.computed_tokens

    def _step(self, batch: LiveBatch, results: list[Completion | None], stats: GenerationStats,
              steps: list[StepRecord] | None, draining: bool) -> None:
        rows = batch.rows
        plan = self._plan(rows, draining, stats)
        started = time.perf_counter()
        proposal, shadow = self._draft(rows, plan)
        drafted = time.perf_counter()
        verdict, lens, width = self._verify(batch, proposal)
        verified = time.perf_counter()
        accepted = verdict.accepted.tolist()
        stats.record(width, lens, accepted)
        if proposal is not None:
            passes = proposal.passes
            stats.draft_passes += plan.width * self.drafter.passes_per_token if passes is None else passes
        stats.draft_s += drafted - started
        stats.verify_s += verified - drafted
        for row, drafted_len, acc in zip(rows, lens, accepted):
            row.target_passes, row.drafted, row.accepted = row.target_passes + 1, row.drafted + drafted_len, row.accepted + acc
        confidence = None if proposal is None or proposal.confidence is None else proposal.confidence.numpy()
        step = StepRecord(*np.array([plan.offered, lens, accepted]), width + 1, drafted - started, verified - drafted,
                          confidence)
        if steps is not None:
            steps.append(step)
        observing = time.perf_counter()
        self.controller.observe(step if shadow is None else _shadow_step(step, plan.shadow, shadow, verdict))
        stats.controller_s += time.perf_counter() - observing
        self._accept(batch, verdict, results, stats)

    def _plan(self, rows: list[Row], draining: bool, stats: GenerationStats) -> _Plan:
        """The controller's per-row offers, capped by the tokens each row may still generate; while the batch
        drains the controller also sees those budgets (the batch ends with its slowest row)."""
        budgets = np.array([self.settings.max_new_tokens - r.generated - 1 for r in rows]).clip(min=0)
        started = time.perf_counter()
        chosen = self.controller.choose(len(rows), budgets + 1 if draining else None)
        stop = self.controller.draft_stop()
        stats.controller_s += time.perf_counter() - started
        return _Plan(np.minimum(chosen, budgets).tolist(), stop, np.minimum(budgets, 1).tolist())

    def _draft(self, rows: list[Row], plan: _Plan) -> tuple[Proposal | None, Proposal | None]:
        """The proposal to verify (cut at the confidence stop when the drafter reports confidence), and
        when no row drafts, a model-free drafter's shadow guess.

        The shadow guess costs microseconds; comparing it with the token the target then picks measures
        acceptance for free, so the controller knows when speculation would pay again without spending a
        wider verify pass to find out."""
        if plan.width:
            return propose_within(self.drafter, plan.stop, rows, plan.width, plan.offered), None
        if self.drafter.passes_per_token == 0 and any(plan.shadow):
            return None, self.drafter.propose(rows, 1, plan.shadow)
        return None, None

    def _verify(self, batch: LiveBatch, proposal: Proposal | None) -> tuple[Verdict, list[int], int]:
        """One target pass over each row's last token and its drafts; the drafts it accepts, per row."""
        n, s = len(batch), self.settings
        lens = torch.zeros(n, dtype=torch.long) if proposal is None else proposal.lengths
        width = int(lens.max()) if n else 0
        drafts = torch.zeros(n, 0, dtype=torch.long) if proposal is None else proposal.tokens[:, :width]  # (n, width)
        inputs = torch.cat([torch.tensor([[r.tokens[-1]] for r in batch.rows]), drafts], 1)      # (n, width + 1)
        hidden = batch.target.forward(inputs)                                                   # (n, width + 1, d)
        logits = self.target.logits(hidden)
        device = logits.device
        if s.sampling.greedy:
            verdict = verify_greedy(logits, drafts.to(device), lens.to(device))
        else:
            probs = None if proposal is None or proposal.probs is None else proposal.probs[:, :width]
            verdict = verify_sampled(logits, drafts.to(device), lens.to(device), s.sampling,
                                     [r.seed for r in batch.rows], [r.generated for r in batch.rows], probs)
        self.drafter.verified(batch.rows, hidden, verdict.accepted)
        if s.logprobs is not None:
            for row, (chosen, tops) in zip(batch.rows, token_logprobs(logits, verdict.tokens, s.logprobs)):
                row.logprobs += chosen
                row.top_logprobs += tops
        return verdict, lens.tolist(), width

    def _accept(self, batch: LiveBatch, verdict: Verdict, results: list[Completion | None], stats: GenerationStats) -> None:
        """Keep each row's verified tokens in the cache and the row; retire the rows that finished."""
        batch.target.advance(verdict.accepted + 1)
        finished = []
        for slot, (index, row, new) in enumerate(zip(batch.indexes, batch.rows, verdict.tokens)):
            before = row.generated
            done = self._append(row, new)
            stats.generated_tokens += row.generated - before
            if done is not None:
                results[index] = done
                finished.append(slot)
        batch.retire(finished)

    def _append(self, row: Row, new: list[int]) -> Completion | None:
        """Add verified tokens to a row; return its Completion if it has finished."""
        reason = None
        for i, token in enumerate(new):
            if token in self.eos:
                new, reason = new[: i + 1], "stop"
                break
        room = self.settings.max_new_tokens - row.generated
        if len(new) > room or (len(new) == room and reason is None):
            new, reason = new[:room], "length"
        before = row.generated
        row.tokens.extend(new)
        generated = row.tokens[row.prompt_len :]
        if self.settings.stop:
            cut = self._stop_cut(generated, before)
            if cut is not None:
                del row.tokens[row.prompt_len + cut[0] :]
                return self._completion(row, cut[1], "stop")
        if reason is None:
            return None
        return self._completion(row, self.tokenizer.decode(generated, skip_special_tokens=True), reason)

    def _completion(self, row: Row, text: str, reason: str) -> Completion:
        tokens = row.tokens[row.prompt_len :]
        logprobs = None if self.settings.logprobs is None else row.logprobs[: len(tokens)]
        tops = None if self.settings.logprobs is None else row.top_logprobs[: len(tokens)]
        return Completion(tokens, text, reason, None, row.prompt_len, row.target_passes, row.drafted, row.accepted,
                          logprobs, tops)

    def _stop_cut(self, generated: list[int], before: int) -> tuple[int, str] | None:
        """If a stop string appeared, the fewest tokens that contain it and the text before it.

        One decode of the completion per step finds whether a stop appeared; only then are the step's
        new tokens decoded one prefix at a time to find where (a stop spans tokens, and decoding is not
        additive across token boundaries)."""
        if not any(stop in self.tokenizer.decode(generated, skip_special_tokens=True) for stop in self.settings.stop):
            return None
        for m in range(before + 1, len(generated) + 1):
            text = self.tokenizer.decode(generated[:m], skip_special_tokens=True)
            cuts = [text.find(stop) for stop in self.settings.stop if stop in text]
            if cuts:
                return m, text[: min(cuts)]
        return None
