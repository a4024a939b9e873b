"""Token choice and draft verification: greedy, and sampling that keeps the target's distribution exactly.

Randomness is counter-based: the noise used for output position t of a row depends only on the row's
seed and t (and, for the per-token noise, the token id). A row's completion therefore never depends on
which rows share its batch.

Two couplings of a sampling draft with the target (`SamplingParams.coupling`):
- invariant (Daliri et al. 2024, drafter-invariant speculative decoding): the target's token at position t
  is argmax_v p_t(v) / E_t(v) with per-token Exp(1) noise E_t (Gumbel-max in the exponential form: log p
  - log E, and -log E is Gumbel), an exact sample from p_t. A draft model proposes argmax_v q_t(v) / E_t(v)
  with the same noise, and drafts are accepted while they equal the target's tokens, so the completion is a
  function of (target, seed) whatever drafted it.
- rejection (Leviathan et al. 2023): accept a draft x with min(1, p(x)/q(x)), else draw from
  norm(max(p - q, 0)). It accepts more, but a draft model's own draws then shape the completion.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

_MASK64 = (1 << 64) - 1

# Random streams: independent noise for the same (seed, position), one stream per use.
TARGET_STREAM = 0       # the target's own draw at each output position (rejection coupling)
ACCEPT_STREAM = 1       # accept/reject tests against a sampled draft's q
DRAFT_STREAM = 2        # a sampling draft model's own draws (rejection coupling)
NOISE_STREAM = 3        # the per-token noise that target and drafts share (invariant coupling)


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def _keys(seeds: list[int], starts: list[int], width: int, stream: int) -> list[list[int]]:
    """Unsigned 64-bit hashes: entry [r][j] is a pure function of (seed_r, start_r + j, stream)."""
    return [[_splitmix64(_splitmix64(seed ^ (stream << 56)) ^ (start + j)) for j in range(width)]
            for seed, start in zip(seeds, starts)]


def uniforms(seeds: list[int], starts: list[int], width: int, stream: int) -> torch.Tensor:
    """(rows, width) float64 uniforms in [0, 1): entry [r, j] is a pure function of (seed_r, start_r + j, stream)."""
    keys = _keys(seeds, starts, width, stream)
    return torch.tensor([[key >> 11 for key in row] for row in keys], dtype=torch.float64).mul_(2.0 ** -53)


def _signed(x: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits."""
    return x - (1 << 64) if x >> 63 else x


_GOLDEN, _FMIX1, _FMIX2 = _signed(0x9E3779B97F4A7C15), _signed(0xFF51AFD7ED558CCD), _signed(0xC4CEB9FE1A85EC53)


def _xorshift_(x: torch.Tensor, shift: int, scratch: torch.Tensor) -> None:
    """x ^= x >> shift as unsigned 64-bit integers (torch shifts int64 arithmetically: sign copies are masked off)."""
    torch.bitwise_right_shift(x, shift, out=scratch).bitwise_and_((1 << (64 - shift)) - 1)
    x.bitwise_xor_(scratch)


def _position_keys(seeds: list[int], starts: list[int], width: int, device: torch.device) -> torch.Tensor:
    """(rows * width,) int64: the noise stream's key of each (row, output position), row-major."""
    keys = torch.tensor(_keys(seeds, starts, width, NOISE_STREAM), dtype=torch.uint64).view(torch.int64)
    return keys.view(-1).to(device)


def _negative_exponentials(keys: torch.Tensor, token_ids: torch.Tensor) -> torch.Tensor:
    """(positions, tokens) float32 -E: log(1 - w) for w uniform in (0, 1), the 53 low bits of MurmurHash3's
    64-bit finalizer of the position's key xor the token's Weyl salt (splitmix64 over token ids). In place,
    as the tensors are large; log1p keeps full float precision where E is small, at the entries that win."""
    x = keys.unsqueeze(-1) ^ (token_ids * _GOLDEN)
    scratch = torch.empty_like(x)
    for multiplier in (_FMIX1, _FMIX2):
        _xorshift_(x, 33, scratch)
        x.mul_(multiplier)
    _xorshift_(x, 33, scratch)
    return x.bitwise_and_((1 << 53) - 1).float().add_(0.5).mul_(-(2.0 ** -53)).log1p_()


def exponentials(seeds: list[int], starts: list[int], width: int, token_ids: torch.Tensor) -> torch.Tensor:
    """(rows, width, tokens) float32 Exp(1) noise on token_ids' device: entry [r, j, i] is a pure function of
    (seed_r, start_r + j, token_ids[i]), so a draft over a subset of the vocabulary sees the target's values."""
    keys = _position_keys(seeds, starts, width, token_ids.device)
    return _negative_exponentials(keys, token_ids).neg_().view(len(seeds), width, len(token_ids))


def race(probs: torch.Tensor, seeds: list[int], starts: list[int], token_ids: torch.Tensor | None = None
         ) -> torch.Tensor:
    """(rows, width) indexes of argmax_v probs(v) / E(v) over probs (rows, width, tokens): a sample from each
    distribution (unnormalised is fine), coupled across distributions by the shared noise E. token_ids names
    the full-vocabulary id of each column (default: column i is token i).

    On a CPU the positions go in blocks of about 2^18 noise entries, so that each of the hash's dozen passes
    reads and writes cache rather than memory (3x faster at 16 rows x 9 positions x 49152 tokens)."""
    rows, width, tokens = probs.shape
    if token_ids is None:
        token_ids = torch.arange(tokens, device=probs.device)
    keys, flat = _position_keys(seeds, starts, width, probs.device), probs.reshape(rows * width, tokens)
    block = max(1, (1 << 18) // tokens) if probs.device.type == "cpu" else len(keys)
    # argmax p / E = argmin p / (-E): p >= 0 and -E < 0
    winners = [torch.div(flat[i : i + block], _negative_exponentials(keys[i : i + block], token_ids)).argmin(-1)
               for i in range(0, len(keys), block)]
    return torch.cat(winners).view(rows, width)


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    coupling: Literal["invariant", "rejection"] = "invariant"  # how a sampling draft is verified (module doc)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def invariant(self) -> bool:
        return self.coupling == "invariant"


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


def draft_sample(probs: torch.Tensor, params: SamplingParams, seeds: list[int], positions: list[int],
                 token_ids: torch.Tensor | None = None) -> torch.Tensor:
    """A sampling draft's token per row at one output position each: an index into probs (rows, tokens).
    Invariant coupling races the draft with the target's own noise at that position, so the draft is the
    target's token whenever the two races agree; rejection coupling draws from the draft's own stream."""
    if params.invariant:
        return race(probs.unsqueeze(1), seeds, positions, token_ids).squeeze(1)
    return inverse_cdf(probs, uniforms(seeds, positions, 1, stream=DRAFT_STREAM).squeeze(1))


def verify_sampled(logits: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor, params: SamplingParams,
                   seeds: list[int], positions: list[int], draft_probs: torch.Tensor | None = None) -> Verdict:
    """Speculative sampling that leaves the target distribution unchanged.

    Invariant coupling: the target's token at each position is its race against the shared noise; drafts
    are accepted while they equal those tokens (draft_probs are not needed). Rejection coupling: with draft
    probabilities q (a sampling draft model) the textbook rule of Leviathan et al. 2023: accept x with
    min(1, p(x)/q(x)), on rejection draw from norm(max(p - q, 0)), and draw a bonus token from p after
    k acceptances. Deterministic drafters (n-gram, greedy drafts) have a one-hot q; the same rule then reads
    "accept x with probability p(x), else draw from p without x", which is exactly "draw y from p with the
    position's own uniform and accept while y == x". That form is used for them, so a row's completion is
    the same whatever k and deterministic drafter were used.
    """
    # logits (n, w, vocab) for w = 1 + k fed positions; drafts (n, k); draft_lens (n,); draft_probs (n, k, vocab)
    probs = probabilities(logits, params)
    if params.invariant or draft_probs is None:
        targets = _target_samples(probs, params, seeds, positions)
        return _verdict(drafts, draft_lens, targets, drafts == targets[:, : drafts.shape[1]])
    return _leviathan(probs, drafts, draft_lens, seeds, positions, draft_probs)


def _target_samples(probs: torch.Tensor, params: SamplingParams, seeds: list[int], positions: list[int]
                    ) -> torch.Tensor:
    """The target's own sample (rows, width) at each fed position, from the coupling's noise."""
    if params.invariant:
        return race(probs, seeds, positions)
    return inverse_cdf(probs, uniforms(seeds, positions, probs.shape[1], stream=TARGET_STREAM))


def _leviathan(probs: torch.Tensor, drafts: torch.Tensor, draft_lens: torch.Tensor, seeds: list[int],
               positions: list[int], draft_probs: torch.Tensor) -> Verdict:
    """The textbook rule for drafts sampled from q = draft_probs (see verify_sampled)."""
    rows, width = probs.shape[0], probs.shape[1]
    u = uniforms(seeds, positions, width, stream=TARGET_STREAM)
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
