"""Distil an MTP head from the target's own completions, and measure what it would buy.

Features come from one no-grad target forward over prompt + completion: the last hidden state h_i as the
LM head reads it (after the final norm, as the verify pass gives it to the drafter) and the target's greedy
token at every position.
Training unrolls the head `depth` times the way drafting chains it: depth d at anchor i reads the head's
own state from depth d-1 and the token t_{i+d}, and attends to the real entries 0..i and to the chained
entries of anchor i only (EAGLE-3's training-time test). Loss: cross-entropy on the realised tokens plus
KL to the target's distribution (both over the draft vocabulary). Acceptance per draft position is scored
with argmax drafts against the target's greedy tokens, exactly as greedy drafting would be verified.
"""
from __future__ import annotations

import math
import random
import time
from collections import Counter
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from tqdm import tqdm
from transformers import PreTrainedModel

from workers.engine.cached_lm import CachedLM
from workers.engine.decoding_model import DecodingModel
from workers.engine.mtp_drafter import CachedHead, DraftHead
from workers.mtp_head import HeadSpec, MTPHead


@dataclass
class Example:
    tokens: torch.Tensor    # (L,) prompt + completion
    hidden: torch.Tensor    # (L, d) the target's last hidden states (after the final norm), fp32
    greedy: torch.Tensor    # (L,) the target's argmax at each position: its choice for the next token
    start: int              # index of the first completion token


@torch.no_grad()
def target_features(target: PreTrainedModel, sequences: list[tuple[list[int], list[int]]],
                    batch_tokens: int = 2048, progress: bool = False) -> list[Example]:
    """One target forward per batch of (prompt ids, completion ids); examples come back in input order."""
    decoder, lm_head = target.get_decoder(), target.get_output_embeddings()
    device = lm_head.weight.device
    examples: list[Example | None] = [None] * len(sequences)
    with tqdm(total=len(sequences), desc="target features", unit="seq", disable=not progress) as bar:
        for batch in _batches(sorted(range(len(sequences)), key=lambda i: -sum(map(len, sequences[i]))),
                              lambda i: sum(map(len, sequences[i])), batch_tokens):
            rows = [sequences[i][0] + sequences[i][1] for i in batch]
            width = max(map(len, rows))
            ids = torch.tensor([r + [0] * (width - len(r)) for r in rows], device=device)
            hidden = decoder(input_ids=ids).last_hidden_state  # right padding: causal rows never see it
            for i, row, states in zip(batch, rows, hidden):
                n = len(row)
                examples[i] = Example(torch.tensor(row), states[:n].float().cpu(), lm_head(states[:n]).argmax(-1).cpu(),
                                      len(sequences[i][0]))
            bar.update(len(batch))
    return examples  # type: ignore[return-value]


def _batches(order: list[int], length, budget: int) -> list[list[int]]:
    """Consecutive groups of `order` whose padded size (rows x longest) stays within `budget` tokens."""
    groups, current, longest = [], [], 0
    for i in order:
        longest_with = max(longest, length(i))
        if current and longest_with * (len(current) + 1) > budget:
            groups.append(current)
            current, longest_with = [], length(i)
        current.append(i)
        longest = longest_with
    return groups + [current] if current else groups


def frequent_tokens(examples: list[Example], size: int, vocab_size: int) -> torch.Tensor | None:
    """A draft vocabulary of `size` sorted ids: the completions' tokens by frequency, then the prompts', then
    the lowest ids not yet in (a BPE tokenizer numbers its merges in the order it learnt them, most common
    first), so a head distilled from a few rows can still draft tokens those rows never used. None for size 0
    or at least the whole vocabulary, which means the full vocabulary."""
    if size <= 0 or size >= vocab_size:
        return None
    completions = Counter(t for e in examples for t in e.tokens[e.start :].tolist())
    prompts = Counter(t for e in examples for t in e.tokens[: e.start].tolist())
    ranked = sorted(completions.keys() | prompts.keys(), key=lambda t: (-completions[t], -prompts[t], t))[:size]
    chosen = set(ranked)
    filler = (t for t in range(vocab_size) if t not in chosen)
    return torch.tensor(sorted(ranked + [next(filler) for _ in range(size - len(ranked))]))


@dataclass
class _Batch:
    anchors: int                # A = L - 1 for the longest example L: anchor i pairs h_i with t_{i+1}
    hidden: torch.Tensor        # (B, L + depth, d) padded
    tokens: torch.Tensor        # (B, L + depth) padded
    greedy: torch.Tensor        # (B, L + depth) padded
    scored: torch.Tensor        # (B, L + depth) bool: a completion token (drafts are scored on these)


def _collate(examples: list[Example], depth: int, device: torch.device) -> _Batch:
    width = max(len(e.tokens) for e in examples)
    hidden = torch.zeros(len(examples), width + depth, examples[0].hidden.shape[1])
    tokens = torch.zeros(len(examples), width + depth, dtype=torch.long)
    greedy = torch.zeros_like(tokens)
    scored = torch.zeros_like(tokens, dtype=torch.bool)
    for row, e in enumerate(examples):
        n = len(e.tokens)
        hidden[row, :n], tokens[row, :n], greedy[row, :n] = e.hidden, e.tokens, e.greedy
        scored[row, e.start : n] = True
    return _Batch(width - 1, hidden.to(device), tokens.to(device), greedy.to(device), scored.to(device))


class _Stacked:
    """A training-time 'cache': each depth's keys and values are appended after the previous depths'."""

    def __init__(self):
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}

    def update(self, key: torch.Tensor, value: torch.Tensor, layer_idx: int, **kwargs):
        if layer_idx in self.keys:
            key, value = torch.cat([self.keys[layer_idx], key], 2), torch.cat([self.values[layer_idx], value], 2)
        self.keys[layer_idx], self.values[layer_idx] = key, value
        return key, value


def unroll(head: MTPHead, batch: _Batch, depth: int) -> list[torch.Tensor]:
    """Head states (B, A, d) for depths 1..depth at every anchor i < A = L - 1.

    Depth d at anchor i sits at position i + d - 1 and predicts token i + d + 1; it sees the depth-1 entries
    of anchors <= i and the deeper entries of anchor i, as chained drafting from anchor i does."""
    rows, anchors = batch.hidden.shape[0], batch.anchors
    dtype, device = head.proj.weight.dtype, batch.hidden.device
    causal = torch.ones(anchors, anchors, dtype=torch.bool, device=device).tril()
    own = torch.eye(anchors, dtype=torch.bool, device=device)
    cache, states, state = _Stacked(), [], batch.hidden[:, :anchors]
    for d in range(1, depth + 1):
        visible = torch.cat([causal] + [own] * (d - 1), 1)
        mask = torch.zeros(visible.shape, dtype=dtype, device=device).masked_fill_(~visible, torch.finfo(dtype).min)
        positions = (torch.arange(anchors, device=device) + d - 1).expand(rows, anchors)
        state = head(state, batch.tokens[:, d : d + anchors], positions, mask[None, None], cache)  # chains on itself
        states.append(state)
    return states


def _loss(head: MTPHead, batch: _Batch, depth: int, kl_weight: float, token_index: torch.Tensor) -> torch.Tensor:
    rows_t, anchors = head.head_rows().t(), batch.anchors
    total = torch.zeros((), device=batch.hidden.device)
    for d, states in enumerate(unroll(head, batch, depth), 1):
        scored = batch.scored[:, d + 1 : d + 1 + anchors]
        logits = head.logits(states[scored], rows_t).log_softmax(-1)
        wanted = token_index[batch.tokens[:, d + 1 : d + 1 + anchors][scored]]
        known = wanted >= 0  # a token outside the draft vocabulary can never be drafted: no CE for it
        if known.any():
            total = total + F.nll_loss(logits[known], wanted[known])
        if kl_weight:
            with torch.no_grad():  # the target's own distribution for the same token, over the draft vocabulary
                teacher = head.logits(batch.hidden[:, d : d + anchors][scored], rows_t).log_softmax(-1)
            total = total + kl_weight * F.kl_div(logits, teacher, log_target=True, reduction="batchmean")
    return total / depth


@torch.no_grad()
def acceptance_counts(head: MTPHead, examples: list[Example], positions: int = 4,
                      batch_tokens: int = 4096) -> tuple[list[int], list[int]]:
    """(attempted, accepted) per draft position 1..positions, drafting greedily from every completion anchor:
    position d is attempted where the first d - 1 drafts were all accepted, and accepted where its draft also
    equals the target's greedy token."""
    attempted, accepted = [0] * positions, [0] * positions
    device = head.proj.weight.device
    for group in _batches(list(range(len(examples))), lambda i: len(examples[i].tokens), batch_tokens):
        batch = _collate([examples[i] for i in group], positions, device)
        anchors = batch.anchors
        alive = torch.ones(batch.hidden.shape[0], anchors, dtype=torch.bool, device=device)
        for d, states in enumerate(unroll(head, batch, positions), 1):
            alive = alive & batch.scored[:, d + 1 : d + 1 + anchors]
            guess = head.to_full_vocab(head.logits(states).argmax(-1))
            attempted[d - 1] += int(alive.sum())
            alive = alive & (guess == batch.greedy[:, d : d + anchors])
            accepted[d - 1] += int(alive.sum())
    return attempted, accepted


def acceptance(head: MTPHead, examples: list[Example], positions: int = 4) -> list[float]:
    """Conditional greedy acceptance at draft positions 1..positions: the share of drafts at position d that
    are accepted, counting only anchors whose drafts 1..d-1 were accepted."""
    return reach(head, examples, positions)[0]


def reach(head: MTPHead, examples: list[Example], positions: int = 4) -> tuple[list[float], list[float]]:
    """(conditional, unconditional) acceptance by position; unconditional: the share of all anchors whose
    drafts 1..d are all accepted, i.e. how often a k-token draft yields at least d tokens."""
    attempted, accepted = acceptance_counts(head, examples, positions)
    conditional = [a / t if t else float("nan") for a, t in zip(accepted, attempted)]
    return conditional, [a / attempted[0] if attempted[0] else float("nan") for a in accepted]


@dataclass
class TrainSettings:
    seconds: float                          # the training budget (wall clock, evaluations included)
    max_steps: int | None = None
    lr: float = 1e-3
    batch_tokens: int = 2048                # padded tokens per step
    depth: int = 2                          # unrolled draft positions trained (1: DeepSeek's MTP, 2+: chained)
    kl_weight: float = 1.0
    eval_every_s: float = 60.0
    eval_examples: int = 64                 # held-out examples scored for the curve (all of them at the end)
    patience: int = 3                       # evaluations without a better held-out acceptance before stopping
    seed: int = 0


@dataclass
class TrainResult:
    steps: int = 0
    seconds: float = 0.0
    stopped: str = ""                                # why training ended
    kept_step: int = 0                               # the step whose weights were kept (best held-out acceptance)
    curve: list[dict] = field(default_factory=list)  # {minutes, cpu_minutes, step, loss, heldout_accept_1}


class _Progress:
    """When training stops, and the curve: held-out acceptance at draft position 1, evaluated every
    eval_every_s. The loss is a running mean of the training batches' losses; there is none before step 1."""

    def __init__(self, head: MTPHead, probe: list[Example], settings: TrainSettings, clock_start: float, bar: tqdm):
        self.head, self.probe, self.settings, self.clock_start, self.bar = head, probe, settings, clock_start, bar
        self.started = self.last_eval = time.perf_counter()
        self.result, self.loss, self.best, self.stale = TrainResult(), None, -1.0, 0
        self.best_state: dict[str, torch.Tensor] | None = None

    def step(self, loss: float) -> None:
        self.result.steps += 1
        self.loss = loss if self.loss is None else 0.9 * self.loss + 0.1 * loss
        self.bar.update(1)
        self.bar.set_postfix(self._postfix(), refresh=False)
        if time.perf_counter() - self.last_eval >= self.settings.eval_every_s:
            self.evaluate()

    def evaluate(self) -> None:
        self.head.eval()
        accept = acceptance(self.head, self.probe, positions=1)[0] if self.probe else float("nan")
        self.head.train()
        self.last_eval = time.perf_counter()
        if self.result.steps and not math.isnan(accept):
            if accept > self.best:
                self.best, self.stale, self.result.kept_step = accept, 0, self.result.steps
                self.best_state = {k: v.detach().clone() for k, v in self.head.state_dict().items()}
            else:
                self.stale += 1
        self.result.curve.append({"minutes": (self.last_eval - self.clock_start) / 60,
                                  "cpu_minutes": time.process_time() / 60, "step": self.result.steps,
                                  "loss": self.loss, "heldout_accept_1": accept})
        self.bar.set_postfix({**self._postfix(), "accept_1": f"{accept:.3f}"})

    def _postfix(self) -> dict:
        left = max(0.0, self.settings.seconds - (time.perf_counter() - self.started))
        return {"left": f"{left / 60:.1f}min", **({} if self.loss is None else {"loss": f"{self.loss:.3f}"})}

    def stop_reason(self) -> str | None:
        s, r = self.settings, self.result
        if time.perf_counter() - self.started >= s.seconds:
            return f"time budget reached ({s.seconds / 60:.1f} min)"
        if s.max_steps is not None and r.steps >= s.max_steps:
            return f"step limit reached ({s.max_steps} steps)"
        if s.patience and self.stale >= s.patience:
            return (f"held-out acceptance stopped improving: best {self.best:.3f}, not beaten in the last "
                    f"{self.stale} evaluations")
        return None

    def finish(self) -> TrainResult:
        """Stop, and keep the weights of the evaluation with the best held-out acceptance (the last ones when
        they are as good, or when nothing was held out): a head trained on a job's first rows overfits them."""
        self.result.stopped = self.stop_reason() or "no training data"
        if self.result.curve[-1]["step"] != self.result.steps:
            self.evaluate()
        if self.best_state is not None and self.result.kept_step != self.result.steps:
            self.head.load_state_dict(self.best_state)
        elif self.best_state is None:
            self.result.kept_step = self.result.steps
        self.result.seconds = time.perf_counter() - self.started
        return self.result


def train(head: MTPHead, examples: list[Example], heldout: list[Example], settings: TrainSettings,
          clock_start: float | None = None, progress: bool = True) -> TrainResult:
    """AdamW on the head's own parameters until the time or step budget runs out, or held-out acceptance
    stops improving. The curve's minutes count from `clock_start` (the start of the whole distillation, data
    generation included); its cpu_minutes are the process's CPU time, which says what the wall clock meant on
    a shared machine."""
    rng = random.Random(settings.seed)
    device = head.proj.weight.device
    token_index = torch.full((head.spec.vocab_size,), -1, dtype=torch.long, device=device)
    ids = torch.arange(head.spec.vocab_size, device=device) if head.vocab_ids is None else head.vocab_ids
    token_index[ids] = torch.arange(len(ids), device=device)
    optimizer = torch.optim.AdamW(head.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.0)
    head.train()
    with tqdm(total=settings.max_steps, unit="step", desc="distill", disable=not progress) as bar:
        tracker = _Progress(head, heldout[: settings.eval_examples], settings,
                            time.perf_counter() if clock_start is None else clock_start, bar)
        tracker.evaluate()
        while examples and tracker.stop_reason() is None:
            order = list(range(len(examples)))
            rng.shuffle(order)
            for group in _batches(order, lambda i: len(examples[i].tokens), settings.batch_tokens):
                if tracker.stop_reason() is not None:
                    break
                elapsed = (time.perf_counter() - tracker.started) / max(settings.seconds, 1e-9)
                for g in optimizer.param_groups:
                    g["lr"] = settings.lr * _schedule(tracker.result.steps, elapsed)
                loss = _loss(head, _collate([examples[i] for i in group], settings.depth, device), settings.depth,
                             settings.kl_weight, token_index)
                optimizer.zero_grad(set_to_none=True)
                loss.backward()
                torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
                optimizer.step()
                tracker.step(loss.item())
        result = tracker.finish()
    head.eval()
    return result


def _schedule(step: int, progress: float, warmup: int = 20) -> float:
    """Linear warmup over the first steps, then cosine decay to a tenth over the time budget."""
    return min(1.0, (step + 1) / warmup) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def distill_head(target: PreTrainedModel, name: str, train_seqs: list[tuple[list[int], list[int]]],
                 held_seqs: list[tuple[list[int], list[int]]], deadline: float, *, layers: int = 1,
                 draft_vocab: int = 8192, depth: int = 2, max_steps: int | None = None,
                 clock_start: float | None = None, progress: bool = False) -> tuple[MTPHead, TrainResult, dict]:
    """Target features, a head over the completions' most frequent tokens, training until `deadline`
    (time.perf_counter) or max_steps, then acceptance per position on held-out and training sequences.
    `specbatch distill` and a learning job (workers/learning.py) both distil with this."""
    examples = target_features(target, train_seqs, progress=progress)
    heldout = target_features(target, held_seqs, progress=progress)
    vocab_ids = frequent_tokens(examples, draft_vocab, target.config.vocab_size)
    spec = HeadSpec.for_target(target, name, layers, 0 if vocab_ids is None else len(vocab_ids))
    head = MTPHead(spec, target).to(target.device)
    if vocab_ids is not None:
        head.vocab_ids.copy_(vocab_ids)
    settings = TrainSettings(seconds=max(0.0, deadline - time.perf_counter()), max_steps=max_steps, depth=depth)
    result = train(head, examples, heldout, settings, clock_start=clock_start, progress=progress)
    conditional, unconditional = reach(head, heldout)
    scores = {"stopped": result.stopped, "kept_step": result.kept_step, "heldout_accept_by_position": conditional,
              "heldout_reach_by_position": unconditional,
              "train_accept_by_position": acceptance(head, examples[: len(heldout)])}
    return head, result, scores


@torch.no_grad()
def measure_costs(head: MTPHead, target: DecodingModel, rows: int, prompt: int = 64, generated: int = 128,
                  max_q: int = 5, repeats: int = 7, warmup: int = 2) -> dict:
    """Median seconds, for `rows` rows of a `prompt`-token prompt generating `generated` tokens, of: the
    prompt's prefill (the target's, then the head's over its states), one head draft step (logits and argmax
    included) and one target verify pass of q = 1..max_q tokens per row with half the completion cached.
    Each is run `warmup` times untimed first (first calls allocate and pick kernels), then timed interleaved."""
    context = prompt + generated // 2
    capacity = context + max_q + 1
    draft = DraftHead.prepare(head, target)
    lm, drafter = CachedLM(target, rows, capacity), CachedHead(draft, rows, capacity)
    hidden = torch.randn(rows, context, head.spec.hidden_size, dtype=drafter.dtype, device=drafter.device)
    ones = torch.ones(rows, context, dtype=torch.long)

    def prefill() -> None:
        lm.prefill([[1] * (prompt + 1)] * rows, 0)
        drafter.lengths[:] = 0
        drafter.forward(hidden[:, :prompt], ones[:, :prompt])

    def fill_context() -> None:  # the cache at mid-completion, which the draft and verify steps read
        lm.prefill([[1] * (context + 1)] * rows, 0)
        drafter.lengths[:] = 0
        drafter.forward(hidden, ones)
        drafter.advance(torch.full((rows,), context))

    step_in = (hidden[:, -1:], ones[:, -1:])
    tasks = {"prefill": prefill, "draft": lambda: draft.logits(drafter.forward(*step_in)).argmax(-1).tolist()}
    tasks |= {q: (lambda q=q: lm.logits(torch.ones(rows, q, dtype=torch.long)).argmax(-1).tolist())
              for q in range(1, max_q + 1)}
    times: dict = {name: [] for name in tasks}
    for round_ in range(warmup + repeats):
        for name, task in tasks.items():
            if name == "draft":
                fill_context()
            began = time.perf_counter()
            task()
            if round_ >= warmup:
                times[name].append(time.perf_counter() - began)
    median = lambda xs: sorted(xs)[len(xs) // 2]  # noqa: E731
    return {"rows": rows, "prompt": prompt, "generated": generated, "prefill_s": median(times["prefill"]),
            "draft_s": median(times["draft"]), "verify_s": {q: median(times[q]) for q in range(1, max_q + 1)}}


def expected_speedup(alphas: list[float], costs: dict) -> dict:
    """Leviathan et al.'s walltime gain with per-position (conditional) acceptance, for whole rows: a pass
    yields E(k) = 1 + sum_j prod_{i<=j} alpha_i tokens at the cost of k draft steps plus one verify of k + 1
    tokens; plain decoding yields one token per width-1 pass; both pay the prompt's prefill."""
    prefill, generated, plain = costs["prefill_s"], costs["generated"], costs["verify_s"][1]
    plain_row = prefill + generated * plain
    best = {"k": 0, "tokens_per_pass": 1.0, "speedup": 1.0}
    for k in range(1, len(costs["verify_s"])):
        tokens, survive = 1.0, 1.0
        for j in range(k):
            survive *= alphas[min(j, len(alphas) - 1)]
            tokens += survive
        speedup = plain_row / (prefill + generated / tokens * (k * costs["draft_s"] + costs["verify_s"][k + 1]))
        if speedup > best["speedup"]:
            best = {"k": k, "tokens_per_pass": tokens, "speedup": speedup}
    return {**best, "cost_ratio": costs["draft_s"] / plain}
