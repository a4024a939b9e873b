"""End to end: real local Ray, real S3 (moto server), tiny random models; every row exactly once."""
from __future__ import annotations

import json
import os
import threading
import time

import pyarrow as pa
import pyarrow.dataset as ds
import pyarrow.parquet as pq
import pytest
import torch

from jobs.cli import describe, main
from pipeline.driver import JobFailed, run_job
from pipeline.job_state import OutputConflict
from pipeline.planner import plan_shards
from tests.pipeline_helpers import (
    assert_exactly_once,
    make_config,
    prompts,
    read_output,
)
from tests.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer
from workers.shard_io import InputError, read_shard
from workers.storage import filesystem, read_bytes

pytestmark = [pytest.mark.timeout(240), pytest.mark.usefixtures("local_ray")]


def test_s3_to_s3_several_files_and_shards(model_dir, s3, write_input):
    bucket = s3.make_bucket()
    opts = s3.storage_options
    sizes = {"a.parquet": 10, "b.parquet": 7, "c.jsonl": 5}
    ids = []
    for name, n in sizes.items():
        rows = prompts(n, prefix=name[0])
        ids += [r["id"] for r in rows]
        write_input(f"{bucket}/in/{name}", rows, opts, row_group_size=3)
    config = make_config(model_dir, f"{bucket}/in/", f"{bucket}/out/run1/",
                         input={"storage_options": opts}, output={"storage_options": opts, "keep_columns": ["task"]},
                         resources={"workers": 2})
    summary = run_job(config, progress=False)
    rows = assert_exactly_once(config, ids)
    assert all(r["finish_reason"] in ("stop", "length") and r["error"] is None for r in rows)
    assert all(r["completion_tokens"] == len(r["completion_token_ids"]) <= 12 for r in rows)
    assert {r["task"] for r in rows} == {"the", "rew", "def", "why"}
    job = summary["job"]
    assert job["rows"] == len(ids) and job["shards"] >= 6 and job["failed_rows"] == 0
    stats = pq.read_table(f"{bucket}/out/run1/stats/shards.parquet".removeprefix("s3://"),
                          filesystem=filesystem(bucket, opts)[0]).to_pylist()
    assert len(stats) == job["shards"] and sum(s["rows"] for s in stats) == len(ids)
    assert {s["worker_id"] for s in stats} <= {"worker-000", "worker-001"}
    assert sum(s["generated_tokens"] for s in stats) == job["generated_tokens"] == sum(r["completion_tokens"] for r in rows)
    assert all(s["started_at"] < s["finished_at"] and s["run_id"] == summary["this_run"]["run_id"] for s in stats)
    assert len({s["ray_node_id"] for s in stats}) == 1 and len(stats[0]["ray_node_id"]) == 56  # one local Ray node
    data = ds.dataset(f"{bucket}/out/run1/data".removeprefix("s3://"), filesystem=filesystem(bucket, opts)[0])
    assert data.count_rows() == len(ids) and data.schema.field("task").type == pa.string()
    report = read_bytes(f"{bucket}/out/run1/report.html", opts).decode()
    assert report.count("<svg") == 4 and 'class="status finished"' in report and "testing" not in report
    manifest = read_bytes(f"{bucket}/out/run1/_job.json", opts).decode()
    assert "testing" not in manifest and json.loads(manifest)["config"]["input"]["storage_options"]["secret"] == "***"


def test_jsonl_chat_input_with_samples(model_dir, tmp_path, write_input):
    rows = [{"id": i, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": f"say {i}"}]}
            for i in range(6)]
    path = write_input(str(tmp_path / "chat.jsonl"), rows)
    config = make_config(model_dir, path, str(tmp_path / "out"), input={"messages_column": "messages"},
                         generation={"samples_per_prompt": 3, "temperature": 0.9, "seed": 7})
    run_job(config, progress=False)
    out = assert_exactly_once(config, [str(i) for i in range(6)], samples=3)
    assert len({r["seed"] for r in out}) == 18
    assert json.loads(out[0]["prompt"])[0]["role"] == "system"


def test_cli_run_with_overrides(model_dir, tmp_path, write_input, write_yaml, capsys):
    path = write_input(str(tmp_path / "in.parquet"), prompts(9))
    config_file = write_yaml({"name": "cli", "input": {"path": path}, "output": {"path": str(tmp_path / "wrong")},
                              "model": {"target": model_dir}, "resources": {"cpus_per_worker": 0.5}})
    out = tmp_path / "right"
    code = main(["run", config_file, "--quiet", "--json", "--set", f"output.path={out}",
                 "--set", "generation.max_new_tokens=5", "--set", "sharding.rows_per_shard=2",
                 "--set", "speculation.k=3", "--set", "resources.batch_size=3", "--set", "generation.logprobs=2"])
    assert code == 0
    summary = json.loads(capsys.readouterr().out)
    assert summary["job"]["shards"] == 5 and summary["job"]["rows"] == 9
    assert not (tmp_path / "wrong").exists()
    rows = [r for f in sorted((out / "data").glob("*.parquet")) for r in pq.read_table(f).to_pylist()]
    assert len(rows) == 9 and max(r["completion_tokens"] for r in rows) <= 5
    for r in rows:  # per-row speculation counters and log-probabilities travel to the Parquet output
        assert len(r["logprobs"]) == len(r["top_logprobs"]) == r["completion_tokens"]
        assert all(len(position) == 2 and position[0]["logprob"] >= position[1]["logprob"] for position in r["top_logprobs"])
        assert r["drafter"] == "ngram" and r["target_passes"] >= 1 and 0 <= r["accepted_tokens"] <= r["drafted_tokens"]
    job = json.loads((out / "_job.json").read_text())
    assert job["config"]["speculation"]["k"] == 3 and job["config"]["resources"]["batch_size"] == 3


def test_resume_skips_committed_shards_keeps_the_job_figures_and_refuses_changed_config(model_dir, tmp_path, write_input):
    path = write_input(str(tmp_path / "in.jsonl"), prompts(12))
    config = make_config(model_dir, path, str(tmp_path / "out"))
    first = run_job(config, progress=False)
    lost = sorted((tmp_path / "out" / "data").glob("*.parquet"))[1]
    lost.unlink()
    (tmp_path / "out" / "_SUCCESS").unlink()
    again = run_job(config, progress=False)
    shards = first["job"]["shards"]
    assert again["this_run"]["shards_resumed"] == shards - 1 and again["this_run"]["shards_run"] == 1
    assert again["job"]["shards"] == shards and again["job"]["generated_tokens"] == first["job"]["generated_tokens"]
    assert again["this_run"]["generated_tokens"] < first["job"]["generated_tokens"]
    assert_exactly_once(config, [f"p{i}" for i in range(12)])
    nothing = run_job(config, progress=False)
    assert nothing["this_run"]["shards_run"] == 0 and nothing["job"] == again["job"]
    assert describe(nothing).startswith(f"nothing to do: all {shards} shards were already committed")
    changed = make_config(model_dir, path, str(tmp_path / "out"), generation={"max_new_tokens": 3})
    with pytest.raises(OutputConflict, match="generation.max_new_tokens"):
        run_job(changed, progress=False)
    assert run_job(changed, overwrite=True, progress=False)["this_run"]["shards_resumed"] == 0


def test_bad_rows_become_error_rows_listed_in_errors_parquet_with_exit_code_3(model_dir, tmp_path, write_yaml, capsys):
    lines = [json.dumps({"id": "ok1", "prompt": "the quick brown fox"}), json.dumps({"id": "null", "prompt": None}),
             "{not json", json.dumps({"id": "empty", "prompt": "  "}), json.dumps({"id": "num", "prompt": 5}),
             json.dumps({"id": "ok2", "prompt": "def add(a, b)"})]
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join(lines) + "\n")
    config = make_config(model_dir, str(path), str(tmp_path / "out"), sharding={"rows_per_shard": 100})
    config_file = write_yaml(config)
    assert main(["run", config_file, "--quiet", "--json"]) == 3
    summary = json.loads(capsys.readouterr().out)
    rows = {r["id"]: r for r in read_output(config)}
    assert len(rows) == 6 and summary["job"]["failed_rows"] == 4 and (tmp_path / "out" / "_SUCCESS").exists()
    assert rows["ok1"]["finish_reason"] != "error" and rows["ok2"]["finish_reason"] != "error"
    for key in ("null", "empty", "num"):
        assert rows[key]["finish_reason"] == "error" and rows[key]["error"]
    bad_json = [r for k, r in rows.items() if k not in ("ok1", "ok2", "null", "empty", "num")][0]
    assert "in.jsonl" in bad_json["error"]
    errors = pq.read_table(tmp_path / "out" / "errors.parquet").to_pylist()
    assert sorted(e["id"] for e in errors) == sorted(k for k, r in rows.items() if r["error"])
    assert all(e["error"] == rows[e["id"]]["error"] and e["sample_index"] == 0 for e in errors)
    retry = make_config(model_dir, str(tmp_path / "out" / "errors.parquet"), str(tmp_path / "retry"))
    again = [r for spec in plan_shards(retry).shards for r in read_shard(spec, retry.input)]
    assert sorted(r.id for r in again) == sorted(e["id"] for e in errors)  # a retry job's input as it stands
    assert main(["run", config_file, "--quiet", "--set", "output.max_failed_rows=4"]) == 0
    assert "nothing to do: all 1 shards were already committed" in capsys.readouterr().out


def _generating_worker_pids() -> list[int]:
    """Worker actors of this test's own Ray (descendants of this process, never another job's on the machine),
    caught inside run_shard (Ray titles the process by the method it runs)."""
    import psutil

    found = []
    for proc in psutil.Process().children(recursive=True):
        try:
            if (proc.cmdline() or [""])[0].startswith("ray::GenerationWorker.run_shard"):
                found.append(proc.pid)
        except psutil.NoSuchProcess:
            continue
    return found


def test_worker_killed_mid_job_is_replaced_and_nothing_is_lost(model_dir, tmp_path, write_input):
    path = write_input(str(tmp_path / "in.jsonl"), prompts(24))
    config = make_config(model_dir, path, str(tmp_path / "out"), generation={"max_new_tokens": 48},
                         speculation={"k": 0}, resources={"batch_size": 1}, sharding={"rows_per_shard": 6})
    killed = []

    def killer():
        deadline = time.time() + 60
        while time.time() < deadline and not killed:
            done = list((tmp_path / "out" / "data").glob("*.parquet")) if (tmp_path / "out" / "data").exists() else []
            pids = _generating_worker_pids() if done else []
            if pids:
                os.kill(pids[0], 9)
                killed.append(pids[0])
            time.sleep(0.2)

    thread = threading.Thread(target=killer)
    thread.start()
    run_job(config, progress=False)
    thread.join()
    assert killed, "the worker was never killed: the job finished too fast for this test"
    assert_exactly_once(config, [f"p{i}" for i in range(24)])
    stats = pq.read_table(tmp_path / "out" / "stats" / "shards.parquet").to_pylist()
    assert max(s["attempt"] for s in stats) == 2 and "worker-001" in {s["worker_id"] for s in stats}


def test_duplicate_ids_are_refused_or_suffixed(model_dir, tmp_path, write_input):
    rows = [{"id": "a", "prompt": "the quick brown fox"}, {"id": "a", "prompt": "def add(a, b)"},
            {"id": "b", "prompt": "why is the sky blue"}]
    path = write_input(str(tmp_path / "in.jsonl"), rows)
    refused = make_config(model_dir, path, str(tmp_path / "out1"), sharding={"rows_per_shard": 10})
    summary = run_job(refused, progress=False)
    out = read_output(refused)
    assert summary["job"]["failed_rows"] == 1
    assert [r["finish_reason"] for r in out if r["id"] == "a"].count("error") == 1
    assert "duplicate id 'a'" in next(r["error"] for r in out if r["error"])
    suffixed = make_config(model_dir, path, str(tmp_path / "out2"), input={"duplicate_ids": "suffix"},
                           sharding={"rows_per_shard": 10})
    run_job(suffixed, progress=False)
    assert sorted(r["id"] for r in read_output(suffixed)) == ["a", "a#1", "b"]


def test_setup_errors_stop_the_job_before_generating(model_dir, tmp_path, write_input):
    path = write_input(str(tmp_path / "in.parquet"), prompts(4))
    with pytest.raises(FileNotFoundError, match="no-such-model"):
        run_job(make_config(str(tmp_path / "no-such-model"), path, str(tmp_path / "o1")), progress=False)
    other = tiny_tokenizer(vocab_size=300)
    draft = save_model_dir(tmp_path / "other-draft", tiny_llama(len(other), layers=1, dtype=torch.float32), other)
    config = make_config(model_dir, path, str(tmp_path / "o2"), model={"drafter": "model", "draft": str(draft)})
    with pytest.raises(JobFailed, match="does not share the target's tokenizer"):
        run_job(config, progress=False)
    assert not (tmp_path / "o2" / "data").exists()
    with pytest.raises(InputError, match="in.parquet.*nope|nope.*in.parquet"):
        run_job(make_config(model_dir, path, str(tmp_path / "o3"), input={"prompt_column": "nope"}), progress=False)


def test_verify_sample_reproduces_rows_without_speculation_and_names_a_row_that_differs(
        model_dir, tmp_path, write_input, write_yaml, capsys):
    path = write_input(str(tmp_path / "in.jsonl"), prompts(10))
    config = make_config(model_dir, path, str(tmp_path / "out"), speculation={"k": "adaptive", "max_k": 4})
    config_file = write_yaml(config)
    assert main(["run", config_file, "--quiet", "--json", "--verify-sample", "6"]) == 0
    verify = json.loads(capsys.readouterr().out)["verify_sample"]
    assert verify["rows"] == 6 and verify["identical"] == 6 and verify["mismatches"] == [] and verify["tokens"] > 0
    # Corrupt one committed row: the check, run again over the finished job, must name it and where.
    first = sorted((tmp_path / "out" / "data").glob("*.parquet"))[0]
    table = pq.read_table(first)
    rows = table.to_pylist()
    tokens = rows[1]["completion_token_ids"]
    tokens[2] = (tokens[2] + 1) % 50
    pq.write_table(pa.Table.from_pylist(rows, schema=table.schema), first)
    assert main(["run", config_file, "--quiet", "--verify-sample", "10"]) == 4
    out = capsys.readouterr().out
    assert "verify-sample: 1 of 10 rows DIFFER" in out and f"id='{rows[1]['id']}' sample 0: token 2 is {tokens[2]}" in out
    summary = json.loads((tmp_path / "out" / "summary.json").read_text())
    assert [(m["id"], m["position"]) for m in summary["verify_sample"]["mismatches"]] == [(rows[1]["id"], 2)]
