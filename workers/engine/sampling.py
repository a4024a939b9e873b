"""Token choice and draft verification: greedy, and sampling that keeps the target's distribution exactly.

Randomness is counter-based: the uniform used for output position t of a row depends only on the
row's seed and t. A row's completion therefore never depends on which rows share its batch.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK64 = (1 << 64) - 1

# Random streams: independent uniforms for the same (seed, position), one stream per use.
TARGET_STREAM = 0       # the target's own draw at each output position
ACCEPT_STREAM = 1       # accept/reject tests against a sampled draft's q
DRAFT_STREAM = 2        # a sampling draft model's own draws


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def uniforms(seeds: list[int], starts: list[int], width: int, stream: int) -> torch.Tensor:
    """(rows, width) float64 uniforms in [0, 1): entry [r, j] is a pure function of (seed_r, start_r + j, stream)."""
    out = [[_splitmix64(_splitmix64(seed ^ (stream << 56)) ^ (start + j)) >> 11 for j in range(width)]
           for seed, start in zip(seeds, starts)]
    return torch.tensor(out, dtype=torch.float64).mul_(2.0 ** -53)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def probabilities(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (the order of transformers' processors), then softmax, in fp32."""
    logits = logits.float() / params.temperature
    if 0 < params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=False)
        cumulative = sorted_logits.softmax(-1).cumsum(-1)
        drop_sorted = cumulative <= 1 - params.top_p
        drop_sorted[..., -1] = False
        logits = logits.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
    return logits.softmax(-1)


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """Sample index ~ weights/sum(weights) (unnormalised is fine) with the given uniforms, one per row."""
    cdf = weights.double().cumsum(-1)
    idx = torch.searchsorted(cdf, (u.to(cdf.device) * cdf[..., -1]).unsqueeze(-1)).squeeze(-1)
    return idx.clamp_(max=weights.shape[-1] - 1)


def token_logprobs(logits: torch.Tensor, tokens: list[list[int]], top: int
                   ) -> list[tuple[list[float], list[list[tuple[int, float]]]]]:
    """Per row: the log-probability of each of its tokens under the logits (n, w, vocab) at the positions
    that chose them, and the `top` most likely (token, log-probability) pairs at each of those positions."""
    logp = torch.log_softmax(logits.float(), -1)
    best = logp.topk(top, -1) if top else None
    out = []
    for r, row in enumerate(tokens):
        chosen = logp[r, torch.arange(len(row)), torch.tensor(row, device=logp.device)].tolist()
        tops = [] if best is None else [list(zip(i, v)) for i, v in zip(best.indices[r, : len(row)].tolist(),
                                                                         best.values[r, : len(row)].tolist())]
        out.append((chosen, tops))
    return out


@dataclass
class Verdict:
    """Per row: how many drafts were accepted, and the tokens to append (accepted drafts + one more)."""
    accepted: torch.Tensor          # (rows,) long
    tokens: list[list[int]]


def _verdict(drafts: torch.Tensor, draft_lens: torch.Tensor, targets: torch.Tensor, match: torch.Tensor) -> Verdict:
    valid = torch.arange(drafts.shape[1], device=drafts.device) < draft_lens.unsqueeze(1)
    accepted = (match & valid).long().cumprod(1).sum(1)
    acc, d, t = accepted.tolist(), drafts.tolist(), targets.tolist()
    return Verdict(accepted.cpu(), [d[r][:a] + [t[r][a]] for r, a in enumerate(acc)])


def verify_greedy(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor) -> Verdict:
    """Accept drafts while they equal the target's argmax; append the target's own next token."""
    targets = logits.argmax(-1)
    return _verdict(drafts, draft_lens, targets, drafts == targets[:, : drafts.shape[1]])


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor, params: SamplingParams,
                   seeds: list[int], positions: list[int], draft_probs: torch.Tensor | None = None) -> Verdict:
    """Speculative sampling that leaves the target distribution unchanged (Leviathan et al. 2023).

    With draft probabilities q (a sampling draft model) this is the textbook rule: accept x with
    min(1, p(x)/q(x)), on rejection draw from norm(max(p - q, 0)), and draw a bonus token from p after
    k acceptances. Deterministic drafters (n-gram, greedy drafts) have a one-hot q; the same rule
    then reads "accept x with probability p(x), else draw from p without x", which is exactly
    "draw y from p with the position's own uniform and accept while y == x". That form is used for
    them, so a row's completion is the same whatever k and drafter were used.
    """
    # logits (n, w, vocab) for w = 1 + k fed positions; drafts (n, k); draft_lens (n,); draft_probs (n, k, vocab)
    probs = probabilities(logits, params)
    rows, width = probs.shape[0], probs.shape[1]
    u = uniforms(seeds, positions, width, stream=TARGET_STREAM)
    if draft_probs is None:
        targets = inverse_cdf(probs, u)
        return _verdict(drafts, draft_lens, targets, drafts == targets[:, : drafts.shape[1]])
    k = drafts.shape[1]
    # p_x, q_x (n, k): the target's and the draft's probability of each drafted token
    p_x = probs[:, :k].gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    q_x = draft_probs.gather(-1, drafts.unsqueeze(-1)).squeeze(-1)
    u_accept = uniforms(seeds, positions, k, stream=ACCEPT_STREAM).to(probs.device)
    accept = u_accept < (p_x.double() / q_x.double().clamp_min(1e-30))
    valid = torch.arange(k, device=drafts.device) < draft_lens.unsqueeze(1)
    accepted = (accept & valid).long().cumprod(1).sum(1)
    at = accepted.view(rows, 1, 1).expand(rows, 1, probs.shape[-1])
    p_next = probs.gather(1, at).squeeze(1)  # (n, vocab): the target's distribution at the first unaccepted position
    # q is zero past the last draft (a row that drafted nothing, or all k accepted: bonus token from p);
    # built with an explicit shape because draft_probs has no column to copy when no row drafted.
    padded_q = torch.cat([draft_probs, draft_probs.new_zeros(rows, 1, probs.shape[-1])], 1)
    rejected = (accepted < draft_lens).unsqueeze(-1)
    weights = torch.where(rejected, (p_next - padded_q.gather(1, at).squeeze(1)).clamp_min(0), p_next)
    u_next = u.gather(1, accepted.view(rows, 1).cpu()).squeeze(1)
    nxt, acc, d = inverse_cdf(weights, u_next).tolist(), accepted.tolist(), drafts.tolist()
    return Verdict(accepted.cpu(), [d[r][:a] + [nxt[r]] for r, a in enumerate(acc)])
