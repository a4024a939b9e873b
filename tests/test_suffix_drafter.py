"""The suffix drafter learns from the job (sibling rows, finished rows, earlier shards), and composed
drafters let the first confident drafter serve each row."""
from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from tests.tiny_models import tiny_llama, tiny_tokenizer
from workers.engine.composed_drafter import ComposedDrafter
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import Drafter, Proposal, Row, pack
from workers.engine.suffix_drafter import SuffixDrafter
from workers.registry import Models
from workers.schemas import ShardStats
from workers.shard_io import ShardSpec
from workers.shard_runner import ShardRunner

PROMPT = [1, 2, 3, 4]


def test_sibling_rows_draft_from_each_other_while_live():
    drafter = SuffixDrafter(max_tokens=1000)
    drafter.start(2, 64)
    a, b = Row(list(PROMPT), 4, 0), Row(list(PROMPT), 4, 1)
    drafter.admit([a, b], 0, None)
    assert drafter.propose([a, b], 4, [4, 4]).lengths.tolist() == [0, 0], "nothing ever followed the prompt"
    a.tokens += [7, 8, 9, 10, 11]
    proposal = drafter.propose([a, b], 4, [4, 4])
    assert proposal.lengths.tolist() == [0, 4]
    assert proposal.tokens[1].tolist() == [7, 8, 9, 10]
    assert drafter.propose([a, b], 4, [4, 2]).tokens[1, :2].tolist() == [7, 8], "caps hold"


def test_finished_rows_are_kept_across_generate_calls_and_length_follows_the_match():
    drafter = SuffixDrafter(max_tokens=1000, spec_factor=1.0)
    drafter.start(1, 64)
    done = Row(list(PROMPT), 4, 0)
    drafter.admit([done], 0, None)
    done.tokens += [7, 8, 9, 10, 11, 12]   # the last tokens arrive with the verify pass that ends the row
    drafter.retire(done)
    drafter.start(2, 64)                   # the next shard
    long, short = Row(list(PROMPT), 4, 1), Row([5, 4], 2, 2)
    drafter.admit([long, short], 0, None)
    proposal = drafter.propose([long, short], 8, [8, 8])
    assert proposal.tokens[0, :4].tolist() == [7, 8, 9, 10]
    assert proposal.lengths.tolist() == [4, 1], "as many tokens as the match is long: [1, 2, 3, 4], then [4]"


def test_uncertain_continuations_are_not_proposed():
    drafter = SuffixDrafter(max_tokens=1000, min_prob=0.4)
    drafter.start(1, 64)
    for ending in ([7, 7], [8, 8], [9, 9]):  # three different continuations of the prompt, once each
        row = Row(list(PROMPT), 4, 0)
        drafter.admit([row], 0, None)
        row.tokens += ending
        drafter.retire(row)
    row = Row(list(PROMPT), 4, 0)
    drafter.admit([row], 0, None)
    assert drafter.propose([row], 4, [4]).lengths.tolist() == [0]  # 1/3 < 0.4
    row.tokens.append(8)
    assert drafter.propose([row], 4, [4]).tokens[0, :1].tolist() == [8]  # [4, 8] was followed by 8 every time


class Fixed(Drafter):
    """Proposes given drafts per row and records what it was asked."""

    def __init__(self, drafts: list[list[int]], probs: torch.Tensor | None = None):
        self.drafts, self.probs, self.asked = drafts, probs, []

    def propose(self, rows, k, caps):
        self.asked.append(list(caps))
        proposal = pack([d[: min(k, c)] for d, c in zip(self.drafts, caps)], k)
        return Proposal(proposal.tokens, proposal.lengths, self.probs)


def test_composition_lets_the_first_confident_drafter_serve_each_row():
    rows = [Row([1], 1, i) for i in range(4)]
    first, second, third = Fixed([[5, 6], [], [], []]), Fixed([[9], [7, 7, 7], [], []]), Fixed([[9], [9], [9], []])
    composed = ComposedDrafter([first, second, third])
    proposal = composed.propose(rows, 3, [3, 3, 1, 3])
    assert proposal.tokens[:, :2].tolist() == [[5, 6], [7, 7], [9, 0], [0, 0]]
    assert proposal.lengths.tolist() == [2, 3, 1, 0]
    assert proposal.source.tolist() == [0, 1, 2, -1]
    assert second.asked == [[0, 3, 1, 3]] and third.asked == [[0, 0, 1, 3]], "served rows are offered nothing"
    assert composed.name == "none+none+none" and proposal.probs is None
    served = ComposedDrafter([Fixed([[5]] * 2), third]).propose(rows[:2], 2, [2, 2])
    assert served.source.tolist() == [0, 0] and len(third.asked) == 1, "no row left: the next drafter is not asked"


def test_composition_gives_one_hot_rows_when_a_sampling_drafter_serves_others():
    q = torch.softmax(torch.randn(2, 2, 10), -1)
    composed = ComposedDrafter([Fixed([[3, 4], []]), Fixed([[1, 2], [5, 6]], probs=q)])
    proposal = composed.propose([Row([1], 1, 0), Row([1], 1, 1)], 2, [2, 2])
    assert proposal.source.tolist() == [0, 1]
    assert torch.equal(proposal.probs[0], torch.nn.functional.one_hot(torch.tensor([3, 4]), 10).to(q.dtype))
    assert torch.equal(proposal.probs[1], q[1])


@pytest.mark.timeout(120)
def test_a_later_shard_drafts_from_an_earlier_shards_outputs(tmp_path, job_config):
    """Two shards through one ShardRunner (as one worker actor runs them): the second shard's prompts
    repeat the first's, so with greedy decoding its completions repeat too; the suffix drafter has
    them indexed, prompt lookup in the row alone does not."""
    tokenizer = tiny_tokenizer()
    models = Models(DecodingModel.prepare(tiny_llama(len(tokenizer), seed=3)), tokenizer)
    prompts = ["the quick brown fox", "def add(a, b):", "why is the sky blue?"]
    url = str(tmp_path / "in.parquet")
    pq.write_table(pa.Table.from_pylist([{"id": f"r{i}", "prompt": p} for i, p in enumerate(prompts * 2)]), url)
    shards = [ShardSpec("shard-00000", url, "parquet", 0, 3), ShardSpec("shard-00001", url, "parquet", 3, 6)]

    def second_shard(drafter: str, first: bool) -> ShardStats:
        config = job_config(url, model={"target": "tiny", "drafter": drafter},
                            generation={"max_new_tokens": 24}, speculation={"k": 4, "max_k": 4},
                            output={"path": str(tmp_path / drafter / str(first))})
        runner = ShardRunner(config, models=models)
        if first:
            runner.run(shards[0])
        return runner.run(shards[1])

    learnt, fresh, lookup = second_shard("suffix", True), second_shard("suffix", False), second_shard("ngram", True)
    assert learnt.generated_tokens == fresh.generated_tokens == lookup.generated_tokens > 0
    assert learnt.accepted_tokens >= 0.6 * learnt.generated_tokens
    assert learnt.accepted_tokens > 2 * max(fresh.accepted_tokens, lookup.accepted_tokens)
    assert learnt.target_passes < lookup.target_passes
