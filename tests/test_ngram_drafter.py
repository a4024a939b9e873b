"""Prompt lookup's confidence: the acceptance it measured for drafts after a match of the same length."""
from __future__ import annotations

import random
from collections import defaultdict

import numpy as np
import pytest
import torch

from jobs.draft_replay import replay_fixed_k
from tests.tiny_models import StubTokenizer, tiny_llama
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.controller import FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.draft_stop import DraftStop
from workers.engine.drafter import Drafter, Proposal, Row, pack
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.ngram_drafter import FIRST_POSITION_PRIOR, MatchOdds, NgramDrafter


def _match(tokens: list[int], size: int, k: int) -> tuple[int, list[int]]:
    """The longest n <= size whose last n tokens occurred earlier, and what followed the latest occurrence."""
    for n in range(min(size, len(tokens) - 1), 0, -1):
        ends = [end for end in range(n - 1, len(tokens) - 1) if tokens[end - n + 1 : end + 1] == tokens[-n:]]
        if ends:
            return n, tokens[ends[-1] + 1 : ends[-1] + 1 + k]
    return 0, []


@pytest.mark.parametrize("seed", [0, 1])
def test_confidence_is_the_conditional_acceptance_counted_by_match_length(seed):
    """Counted independently from the completions: per match length n and draft position j, of the drafts
    that reached j with j - 1 accepted and whose position j the row's next tokens settle, the share equal to
    the token the target picked. Undecayed and without a prior, the drafter's odds are exactly that share."""
    target = DecodingModel.prepare(tiny_llama(24, seed=3, hidden=32))
    rng, k = random.Random(seed), 4
    requests = [Request(str(i), [rng.randrange(24) for _ in range(rng.randrange(4, 12))], seed=i) for i in range(8)]
    settings = GenerationSettings(max_new_tokens=48, batch_size=1, max_k=0)
    completions = [c.token_ids for c in SpeculativeGenerator(target, StubTokenizer(), NgramDrafter(3), FixedK(0),
                                                             settings).generate(requests).completions]
    drafter = NgramDrafter(3)
    drafter.odds = MatchOdds(3, max_k=k, prior_tries=1e-9, decay=1.0)
    replay_fixed_k(drafter, [r.prompt_ids for r in requests], completions, k, 48)

    hits, tries = defaultdict(lambda: np.zeros(k)), defaultdict(lambda: np.zeros(k))
    for request, completion in zip(requests, completions):
        t = 0
        while t < len(completion):
            n, draft = _match(request.prompt_ids + completion[:t], 3, min(k, 48 - t - 1))
            accepted = next((j for j, token in enumerate(draft) if t + j >= len(completion) or token != completion[t + j]),
                            len(draft))
            t += accepted + 1
            if t < len(completion):   # the row's last draft is never settled: nothing follows it
                settled = min(len(draft), accepted + 1, len(completion) - (t - accepted - 1))
                tries[n][:settled] += 1
                hits[n][:accepted] += 1
    assert sum(t[0] for t in tries.values()) > 20 and any(h[0] > 0 for h in hits.values())
    for n in (1, 2, 3):
        counted = np.divide(hits[n], tries[n], out=np.full(k, np.nan), where=tries[n] > 0)
        odds = np.array(drafter.odds.odds(n, k)) if tries[n].any() else np.full(k, np.nan)
        seen = tries[n] > 0
        assert odds[seen] == pytest.approx(counted[seen], abs=1e-6), n


def test_a_stop_cuts_a_weak_match_and_lets_a_strong_one_run():
    """With the tune half's priors (position 1: 0.2 after a 1-token match, 0.8 after a 3-token one), a column
    worth 0.3 expected tokens is drafted for the 3-token match only."""
    drafter = NgramDrafter(3)
    drafter.start(2, 64)
    strong = Row([5, 6, 7, 8, 9, 1, 5, 6, 7], 9, seed=0)     # ...5 6 7 occurred before: copies 8 9 1
    weak = Row([5, 6, 7, 8, 9, 1, 2, 3, 7], 9, seed=0)       # only "7" occurred before: copies 8 9 1
    drafter.admit([strong, weak], 0)
    proposal = drafter.propose([strong, weak], 3, [3, 3])
    assert proposal.lengths.tolist() == [3, 3]
    assert proposal.confidence[:, 0].tolist() == pytest.approx([FIRST_POSITION_PRIOR[2], FIRST_POSITION_PRIOR[0]])
    stop = DraftStop(np.full(3, 0.3))
    assert stop.cut(proposal.confidence[1:], proposal.lengths[1:]).tolist() == [0]
    assert stop.cut(proposal.confidence[:1], proposal.lengths[:1]).tolist() == [3]


def test_odds_follow_the_drafts_outcomes_and_a_cut_draft_still_counts():
    """A draft cut short by the stop is still settled by the tokens the row went on to generate."""
    odds = MatchOdds(3, max_k=4, prior_tries=1.0, decay=1.0)
    before = odds.odds(1, 2)
    drafter = NgramDrafter(3)
    drafter.odds = odds
    drafter.start(1, 64)
    row = Row([1, 2, 3, 9, 3], 5, seed=0)   # "3" matched: drafts 9 3 ...
    drafter.admit([row], 0)
    drafter.propose([row], 2, [2])
    row.tokens += [9, 3]                     # the row went on exactly as drafted (however much was verified)
    drafter.propose([row], 2, [2])
    assert odds.odds(1, 2)[0] > before[0] and odds.odds(1, 2)[1] > before[1]
    assert odds.tries[0][:2] == pytest.approx([2.0, 2.0]) and odds.tries[0][2:] == pytest.approx([1.0, 1.0])


class _FirstRowOnly(Drafter):
    """Proposes 7 7 7 for the first row and nothing else, without a confidence."""

    def propose(self, rows: list[Row], k: int, caps: list[int]) -> Proposal:
        return pack([[7] * min(k, caps[0])] + [[] for _ in rows[1:]], k)


def test_a_composed_drafter_reports_its_parts_confidence_and_the_stop_keeps_rows_of_unknown_confidence():
    weak = Row([5, 6, 7, 8, 9, 1, 2, 3, 7], 9, seed=0)
    composed = ComposedDrafter([_FirstRowOnly(), NgramDrafter(3)])
    composed.start(2, 64)
    composed.admit([weak, weak], 0, None)
    proposal = composed.propose([weak, weak], 3, [3, 3])
    assert proposal.source.tolist() == [0, 1] and proposal.lengths.tolist() == [3, 3]
    assert torch.isnan(proposal.confidence[0]).all()
    assert proposal.confidence[1].tolist() == pytest.approx(NgramDrafter(3).odds.odds(1, 3))
    stop = DraftStop(np.full(3, 0.3))
    assert stop.cut(proposal.confidence[1:], proposal.lengths[1:]).tolist() == [0]   # the weak match alone: cut
    assert stop.cut(proposal.confidence, proposal.lengths).tolist() == [3, 3]        # the unknown row holds it
