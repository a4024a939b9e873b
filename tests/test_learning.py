"""A job that learns its drafter: slices (--limit), drafter changes on resume, the learnt head, one suffix corpus.

Real local Ray and a tiny random target. A slice of the job learns the head (a slice waits for its
distillation); the whole job then resumes the slice with the head on every worker from its first shard, and
writes exactly the tokens a job without speculation writes.
"""
from __future__ import annotations

import json

import pytest

from pipeline.corpus_sharing import SharedCorpus
from pipeline.driver import run_job
from pipeline.job_state import OutputConflict
from pipeline.planner import plan_shards
from tests.pipeline_helpers import assert_exactly_once, make_config, prompts, read_output, shard
from workers.model_paths import HEAD_CONFIG, HEAD_REPORT
from workers.shard_runner import ShardRunner
from workers.storage import exists, join, read_bytes

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("local_ray")]


def _tokens(config) -> dict[str, list[int]]:
    return {r["id"]: r["completion_token_ids"] for r in read_output(config)}


@pytest.mark.parametrize("kind", ["parquet", "jsonl"])
def test_limit_plans_the_first_rows_with_the_whole_jobs_shard_ids(model_dir, tmp_path, write_input, kind):
    write_input(str(tmp_path / f"in.{kind}"), prompts(10))
    whole = make_config(model_dir, str(tmp_path / f"in.{kind}"), str(tmp_path / "o"))
    sliced = make_config(model_dir, str(tmp_path / f"in.{kind}"), str(tmp_path / "o"), input={"limit": 6})
    full, part = plan_shards(whole), plan_shards(sliced)
    assert [s.shard_id for s in part.shards] == [s.shard_id for s in full.shards[:2]]
    assert part.shards[0] == full.shards[0] and part.shards[1].stop < full.shards[1].stop
    assert part.total_rows == 6


def test_a_slice_then_the_whole_job_with_another_drafter(model_dir, tmp_path, write_input):
    """--limit runs a slice; the whole job resumes it with another drafter, k and batch size (greedy: the
    output cannot change), reruns the slice's cut shard, and says what changed."""
    rows = prompts(10)
    write_input(str(tmp_path / "in.parquet"), rows)
    first = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"), input={"limit": 6})
    assert run_job(first, progress=False)["job"]["rows"] == 6
    whole = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"), model={"drafter": "suffix"},
                        speculation={"k": 3}, resources={"batch_size": 2})
    summary = run_job(whole, progress=False)
    assert summary["this_run"]["shards_resumed"] == 1  # shard-00001 held rows 4-5 only: it runs again, whole
    assert "model.drafter: 'ngram' -> 'suffix'" in summary["resumed_with_changes"]
    assert "resources.batch_size: 4 -> 2" in summary["resumed_with_changes"]
    assert_exactly_once(whole, [r["id"] for r in rows])
    reference = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "ref"), speculation={"k": 0})
    run_job(reference, progress=False)
    assert _tokens(whole) == _tokens(reference)


def test_a_sampled_job_with_a_model_drafter_refuses_another_drafter(model_dir, tmp_path, write_input):
    write_input(str(tmp_path / "in.parquet"), prompts(4))
    sampled = {"temperature": 0.8}
    first = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"), generation=sampled,
                        model={"drafter": "model", "draft": model_dir}, speculation={"sampling": "rejection"})
    run_job(first, progress=False)
    other = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"), generation=sampled,
                        speculation={"sampling": "rejection"})
    with pytest.raises(OutputConflict, match="model.drafter"):
        run_job(other, progress=False)


def test_a_learning_job_saves_its_head_and_the_whole_job_drafts_with_it(model_dir, tmp_path, write_input):
    rows = prompts(16)
    write_input(str(tmp_path / "in.parquet"), rows)
    learning = {"learn": "mtp", "learn_after_rows": 8, "learn_minutes": 0.1}
    common = dict(model={"drafter": ["suffix", "ngram"]}, sharding={"rows_per_shard": 2})
    first = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"), input={"limit": 8},
                        speculation={**learning, "learn_min_speedup": 100.0}, **common)
    summary = run_job(first, progress=False)  # no head is expected to give 100x: the workers keep their drafters
    assert summary["learning"]["status"] == "kept the configured drafters (the head does not pay)", summary["learning"]
    assert summary["learning"]["expected_speedup"] >= 1.0
    head = join(first.output.path, "drafters", "mtp")
    assert exists(join(head, HEAD_CONFIG)) and exists(join(head, HEAD_REPORT))
    assert json.loads(read_bytes(join(head, HEAD_REPORT)))["expected"]["batch_size"] == first.resources.batch_size

    whole = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"), resources={"workers": 2},
                        speculation={**learning, "learn_min_speedup": 0.0}, **common)
    summary = run_job(whole, progress=False)  # as after a driver killed mid-job: the head is on disk
    assert summary["learning"]["status"] == "resumed with the saved head"
    assert any(c.startswith("speculation.learn_min_speedup: 100.0 -> 0.0") for c in summary["resumed_with_changes"])
    stats = json.loads((tmp_path / "o" / "summary.json").read_text())["job"]
    assert stats["rows"] == 16
    parts = [json.loads(p.read_text()) for p in (tmp_path / "o" / "stats" / "parts").glob("*.json")]
    new = [p for p in parts if p["run_id"] == summary["this_run"]["run_id"]]
    assert new and all(p["drafter"] == "suffix+ngram+mtp" for p in new)
    assert {p["worker_id"] for p in new} == {"worker-000", "worker-001"}  # both switched to the one head
    assert {r["drafter"] for r in read_output(whole) if r["id"] in {p["id"] for p in rows[8:]}} == {"suffix+ngram+mtp"}
    reference = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "ref"), speculation={"k": 0})
    run_job(reference, progress=False)
    assert _tokens(whole) == _tokens(reference)
    fixed = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "fixed"),
                        model={"drafter": "mtp", "draft": head})  # another job names the saved head
    assert run_job(fixed, progress=False)["job"]["drafted_tokens"] > 0
    assert _tokens(fixed) == _tokens(reference)


def test_each_worker_reads_the_others_committed_shards_once():
    config = make_config("m", "in", "/out", model={"drafter": ["suffix", "ngram"]},
                         speculation={"suffix_max_tokens": 300})
    corpus = SharedCorpus(config, [shard(0, "worker-000", "old")])  # an earlier run's: everyone reads it
    assert corpus.unread("worker-000") == ("/out/data/shard-00000.parquet",)
    corpus.commit(shard(1, "worker-000", "r"))
    corpus.commit(shard(2, "worker-001", "r"))
    assert corpus.unread("worker-001") == ("/out/data/shard-00000.parquet", "/out/data/shard-00001.parquet")
    assert corpus.unread("worker-001") == ()
    assert corpus.unread("worker-000") == ("/out/data/shard-00002.parquet",)
    corpus.commit(shard(3, "worker-001", "r"))
    corpus.commit(shard(4, "worker-001", "r"))
    corpus.commit(shard(5, "worker-001", "r"))  # 3 x 100+ tokens: the budget keeps the newest two
    assert corpus.unread("worker-000") == ("/out/data/shard-00004.parquet", "/out/data/shard-00005.parquet")
    assert SharedCorpus(make_config("m", "in", "/out"), []).unread("worker-000") == ()  # no suffix drafter


def test_a_worker_drafts_from_another_workers_completions(model_dir, tmp_path, write_input):
    """Rows another worker completed are in this worker's suffix index: repeating one drafts all of it."""
    rows = prompts(4)
    write_input(str(tmp_path / "in.parquet"), rows)
    config = make_config(model_dir, str(tmp_path / "in.parquet"), str(tmp_path / "o"),
                         model={"drafter": "suffix"}, sharding={"rows_per_shard": 4})
    other = ShardRunner(config, "worker-001")
    spec = plan_shards(config).shards[0]
    other.run(spec)
    reader = ShardRunner(config, "worker-000")
    suffix = reader.generator.drafter
    before = suffix.index.nodes
    reader.read_completions([join(config.output.path, "data", f"{spec.shard_id}.parquet")])
    assert suffix.index.nodes > before
    again = reader.run(spec)
    assert again.accepted_tokens > 0 and again.accepted_tokens == again.drafted_tokens
