"""The batched speculative generator: draft k tokens per row, verify them all in one target pass.

Live rows sit in slots 0..n-1 of a slot KV cache, each with its own length, so rows accept different
numbers of tokens per step without padding or recomputation. A row that finishes leaves at once (the
last live row moves into its slot) and a waiting prompt is admitted, keeping the batch full.
"""
from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from workers.cached_lm import CachedLM
from workers.controller import Controller, StepRecord
from workers.drafters import Drafter, Row
from workers.sampling import SamplingParams, verify_greedy, verify_sampled


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


@dataclass
class GenerationSettings:
    max_new_tokens: int = 128
    sampling: SamplingParams = SamplingParams()
    stop: tuple[str, ...] = ()
    batch_size: int = 16
    max_k: int = 8
    overlong: str = "truncate"      # truncate (keep the prompt's end) | error


@dataclass
class GenerationStats:
    """Counters for one or more generate() calls; they feed the shard statistics."""
    max_k: int
    prompt_tokens: int = 0
    generated_tokens: int = 0
    target_passes: int = 0
    row_passes: int = 0             # rows summed over target passes: tokens per row per pass = generated / this
    draft_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    draft_s: float = 0.0
    verify_s: float = 0.0
    prefill_s: float = 0.0
    attempted_by_position: np.ndarray = field(init=False)
    accepted_by_position: np.ndarray = field(init=False)
    k_hist: np.ndarray = field(init=False)

    def __post_init__(self):
        self.attempted_by_position = np.zeros(self.max_k, dtype=np.int64)
        self.accepted_by_position = np.zeros(self.max_k, dtype=np.int64)
        self.k_hist = np.zeros(self.max_k + 1, dtype=np.int64)

    def record(self, k: int, draft_lens: list[int], accepted: list[int]) -> None:
        self.target_passes += 1
        self.row_passes += len(accepted)
        self.k_hist[k] += 1
        for drafted, acc in zip(draft_lens, accepted):
            self.drafted_tokens += drafted
            self.accepted_tokens += acc
            tried = min(drafted, acc + 1)
            self.attempted_by_position[:tried] += 1
            self.accepted_by_position[:acc] += 1

    @property
    def accept_by_position(self) -> list[float]:
        return [a / t if t else float("nan") for a, t in zip(self.accepted_by_position, self.attempted_by_position)]


class SpeculativeGenerator:
    def __init__(self, target: PreTrainedModel, tokenizer: PreTrainedTokenizerBase, drafter: Drafter,
                 controller: Controller, settings: GenerationSettings):
        self.target, self.tokenizer, self.drafter, self.controller = target, tokenizer, drafter, controller
        self.settings = settings
        self.eos = _eos_ids(target, tokenizer)
        self.context = getattr(target.config, "max_position_embeddings", None) or 1 << 30
        self.stats = GenerationStats(settings.max_k)

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
    def generate(self, requests: list[Request]) -> list[Completion]:
        """Complete every request; results come back in request order."""
        results: list[Completion | None] = [None] * len(requests)
        runnable = []
        for i, request in enumerate(requests):
            ids, error = self._fit(request)
            if error:
                results[i] = Completion([], "", "error", error, len(request.prompt_ids))
            else:
                runnable.append((i, Request(request.id, ids, request.seed)))
        if runnable:
            self._run(runnable, results)
        return results  # type: ignore[return-value]

    def _run(self, runnable: list[tuple[int, Request]], results: list[Completion | None]) -> None:
        s = self.settings
        slots = min(s.batch_size, len(runnable))
        capacity = max(len(r.prompt_ids) for _, r in runnable) + s.max_new_tokens + s.max_k + 2
        target = CachedLM(self.target, slots, capacity)
        self.drafter.start(slots, capacity)
        waiting = deque(sorted(runnable, key=lambda item: len(item[1].prompt_ids)))
        live: list[tuple[int, Row]] = []
        while waiting or live:
            if waiting and len(live) < slots:
                self._admit(target, waiting, live, slots)
            self._step(target, live, results)

    def _admit(self, target: CachedLM, waiting: deque, live: list, slots: int) -> None:
        started = time.perf_counter()
        start, admitted = len(live), []
        while waiting and len(live) + len(admitted) < slots:
            index, request = waiting.popleft()
            admitted.append((index, Row(list(request.prompt_ids), len(request.prompt_ids), request.seed)))
        rows = [row for _, row in admitted]
        target.prefill([r.tokens for r in rows], start)
        self.drafter.admit(rows, start)
        self.controller.admit(start, len(rows))
        live.extend(admitted)
        self.stats.prompt_tokens += sum(r.prompt_len for r in rows)
        self.stats.prefill_s += time.perf_counter() - started

    def _step(self, target: CachedLM, live: list[tuple[int, Row]], results: list[Completion | None]) -> None:
        s, rows = self.settings, [row for _, row in live]
        chosen = self.controller.choose(len(rows))
        budgets = [s.max_new_tokens - r.generated - 1 for r in rows]
        offered = [max(0, min(chosen, b)) for b in budgets]
        k = max(offered)  # no row may use more (its budget ends sooner): draft no further
        started = time.perf_counter()
        proposal = self.drafter.propose(rows, k, offered) if k else None
        # At k = 0 a model-free drafter still guesses one token (microseconds); comparing the guess with
        # the token the target then picks measures acceptance for free, so the controller knows when
        # speculation would pay again without spending a wider verify pass to find out.
        shadow_offer = [min(1, max(0, b)) for b in budgets]
        shadow = (self.drafter.propose(rows, 1, shadow_offer)
                  if not k and self.drafter.passes_per_token == 0 and any(shadow_offer) else None)
        drafted = time.perf_counter()
        lens = torch.zeros(len(rows), dtype=torch.long) if proposal is None else proposal.lengths.clamp(
            max=torch.tensor(offered))
        width = int(lens.max()) if len(rows) else 0
        drafts = torch.zeros(len(rows), 0, dtype=torch.long) if proposal is None else proposal.tokens[:, :width]
        inputs = torch.cat([torch.tensor([[r.tokens[-1]] for r in rows]), drafts], 1)
        logits = target.forward(inputs)
        if s.sampling.greedy:
            verdict = verify_greedy(logits, drafts.to(logits.device), lens.to(logits.device))
        else:
            probs = None if proposal is None or proposal.probs is None else proposal.probs[:, :width]
            verdict = verify_sampled(logits, drafts.to(logits.device), lens.to(logits.device), s.sampling,
                                     [r.seed for r in rows], [r.generated for r in rows], probs)
        verified = time.perf_counter()
        target.advance(verdict.accepted + 1)
        accepted = verdict.accepted.tolist()
        self.stats.record(k, lens.tolist(), accepted)
        if proposal is not None:
            self.stats.draft_passes += k * self.drafter.passes_per_token
        self.stats.draft_s += drafted - started
        self.stats.verify_s += verified - drafted
        if shadow is not None:
            offered = shadow_offer  # a row with no guess missed, as it would have when drafting
            accepted = [int(n > 0 and guess[0] == new[0]) for n, guess, new in
                        zip(shadow.lengths.tolist(), shadow.tokens.tolist(), verdict.tokens)]
        self.controller.observe(StepRecord(k, np.array(offered), np.array(accepted), width + 1,
                                           drafted - started, verified - drafted))
        finished = []
        for slot, ((index, row), new) in enumerate(zip(live, verdict.tokens)):
            done = self._append(row, new)
            if done:
                results[index] = done
                finished.append(slot)
        for slot in reversed(finished):
            last = len(live) - 1
            if slot != last:
                target.move(last, slot)
                self.drafter.move(last, slot)
                self.controller.move(last, slot)
            live[slot] = live[last]
            live.pop()

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
        self.stats.generated_tokens += len(new)
        generated = row.tokens[row.prompt_len :]
        if self.settings.stop:
            cut = self._stop_cut(generated, before)
            if cut is not None:
                del row.tokens[row.prompt_len + cut[0] :]
                return Completion(generated[: cut[0]], cut[1], "stop", None, row.prompt_len)
        if reason is None:
            return None
        return Completion(generated, self.tokenizer.decode(generated, skip_special_tokens=True), reason, None,
                          row.prompt_len)

    def _stop_cut(self, generated: list[int], before: int) -> tuple[int, str] | None:
        """If a stop string appeared, the fewest tokens that contain it and the text before it."""
        for m in range(before + 1, len(generated) + 1):
            text = self.tokenizer.decode(generated[:m], skip_special_tokens=True)
            cuts = [text.find(stop) for stop in self.settings.stop if stop and stop in text]
            if cuts:
                return m, text[: min(cuts)]
        return None


def _eos_ids(model: PreTrainedModel, tokenizer: PreTrainedTokenizerBase) -> set[int]:
    ids = getattr(model.generation_config, "eos_token_id", None)
    ids = set(ids if isinstance(ids, list) else [] if ids is None else [ids])
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return ids
