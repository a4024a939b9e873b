"""--verify-sample's pieces that need no Ray: which rows it picks, how it compares, what it refuses."""
from __future__ import annotations

from jobs.cli import main
from tests.pipeline_helpers import shard
from workers.verify_sample import first_difference, pick_rows


def test_picks_are_spread_over_the_job_stable_and_bounded():
    stats = [shard(i, "w", "r") for i in range(5)]  # 4 rows each
    picks = pick_rows(stats, 8, seed=3)
    assert picks == pick_rows(list(reversed(stats)), 8, seed=3)
    assert sum(len(rows) for rows in picks.values()) == 8 and len(picks) >= 2
    assert all(rows == sorted(set(rows)) and max(rows) < 4 for rows in picks.values())
    everything = pick_rows(stats, 100, seed=3)
    assert sum(len(rows) for rows in everything.values()) == 20


def test_first_difference_marks_the_side_that_ended():
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == (1, 2, 5)
    assert first_difference([1, 2], [1, 2, 7]) == (2, -1, 7)
    assert first_difference([1, 2, 7], [1, 2]) == (2, 7, -1)


def test_sampled_jobs_are_refused_before_anything_runs(write_yaml, tmp_path, capsys):
    config = write_yaml({"name": "s", "input": {"path": str(tmp_path / "missing.jsonl")},
                         "output": {"path": str(tmp_path / "out")}, "model": {"target": str(tmp_path)},
                         "generation": {"temperature": 0.7}})
    assert main(["run", config, "--verify-sample", "4"]) == 1
    assert "only sampling-free jobs" in capsys.readouterr().err and not (tmp_path / "out").exists()
