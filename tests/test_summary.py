"""Shard records add up: whole-job figures over every committed shard, this run's apart."""
from __future__ import annotations

import pytest

from pipeline.summary import RunInfo, busy_seconds, summarize
from tests.pipeline_helpers import shard
from workers.schemas import STATS_SCHEMA, Counters, ShardStats


def test_busy_seconds_counts_overlaps_once_and_gaps_not_at_all():
    assert busy_seconds([(0, 2), (1, 3), (5, 6), (5.5, 5.7)]) == 4
    assert busy_seconds([]) == 0


def test_totals_use_the_same_ratios_as_a_shard():
    a, b = shard(1, "w0", "r"), shard(2, "w1", "r")
    b.k_hist, b.attempted_by_position, b.accepted_by_position = [1, 1], [4], [1]  # a shorter max_k
    total = Counters.total([a, b])
    assert total.generated_tokens == a.generated_tokens + b.generated_tokens
    assert total.k_hist == [a.k_hist[0] + 1, a.k_hist[1] + 1, *a.k_hist[2:]]
    assert total.accept_by_position[0] == pytest.approx((30 + 1) / (60 + 4))
    assert total.tokens_per_row_pass == pytest.approx(total.generated_tokens / total.row_passes)
    assert Counters.total([a]).counters() == {k: v for k, v in a.to_row().items() if k in Counters().counters()}


def test_the_stats_schema_is_the_record_and_its_ratios():
    s = shard(0, "w0", "r")
    assert ShardStats.from_dict(s.to_dict()) == s
    assert set(STATS_SCHEMA.names) == set(s.to_row())


def test_a_stats_part_written_before_controller_s_reads_back_with_none_spent():
    """A job started by an older version resumes: its parts lack `controller_s` (counted in other_s then)."""
    s = shard(0, "w0", "r")
    old = {k: v for k, v in s.to_dict().items() if k != "controller_s"}
    assert ShardStats.from_dict(old).controller_s == 0.0 and ShardStats.from_dict(old).other_s == s.other_s


def test_a_rerun_keeps_the_jobs_figures_and_reports_its_own():
    earlier = [shard(i, "w0", "first") for i in range(3)]
    now = [shard(3, "w0", "second")]
    summary = summarize(earlier + now, RunInfo("second", 0.0, 10.0, 1), "out/")
    job, run = summary["job"], summary["this_run"]
    assert job["shards"] == 4 and job["generated_tokens"] == sum(s.generated_tokens for s in earlier + now)
    assert run["shards_run"] == 1 and run["shards_resumed"] == 3
    assert run["generated_tokens"] == now[0].generated_tokens and run["tokens_per_s"] == now[0].generated_tokens / 10
    nothing = summarize(earlier + now, RunInfo("third", 0.0, 0.5, 0), "out/")
    assert nothing["job"] == job and nothing["this_run"]["generated_tokens"] == 0
