"""`specbatch plan`: a pilot on a sample predicts the job, checked against the job itself run afterwards.

Tiny random model, so the checks are on what does not depend on the model's speed: the generated tokens
the job then makes, the options' arithmetic (k = 0 is the unit, fixed-k tokens per pass follow the closed
form), the replay of a shard's drain, the simulation's label, and the same fast errors as `run`.
"""
from __future__ import annotations

import json
import math

import pytest

from jobs.cli import main
from jobs.plan import PassTimes, replay, tokens_per_row_pass
from tests.pipeline_helpers import make_config, prompts, run_in_process

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_tokens_per_row_pass_is_the_closed_form():
    assert tokens_per_row_pass([0.5, 0.5], 0) == 1.0
    assert tokens_per_row_pass([0.5, 0.5], 2) == pytest.approx(1 + 0.5 + 0.25)
    # an untried position takes the last measured conditional rate
    assert tokens_per_row_pass([0.8, float("nan")], 3) == pytest.approx(1 + 0.8 + 0.64 + 0.512)
    assert tokens_per_row_pass([], 3) == 1.0


def test_replay_counts_the_drain():
    flat = PassTimes({(1, 1): 1.0, (4, 1): 1.0})
    # 4 rows of 10 tokens, one a pass, 2 slots: two waves of 10 passes
    assert replay([10], [4], 2, 1.0, 1, flat, 0.0) == (20.0, 20)
    # lengths 1, 10, 1, 10 in 2 slots: each short row leaves after a pass and the next waiting row takes its
    # slot, so the last long row starts at pass 3 and the shard drains with it alone: 2 + 10 passes
    seconds, passes = replay([1, 10], [4], 2, 1.0, 1, flat, 0.0)
    assert passes == 12 and seconds == 12.0
    per_row = PassTimes({(1, 1): 1.0, (2, 1): 2.0})
    assert replay([10], [2], 2, 2.0, 1, per_row, 0.0) == (10.0, 5)   # 2 tokens a pass, both rows live


def test_plan_predicts_the_jobs_tokens(model_dir, tmp_path, write_input, write_yaml, capsys):
    rows = prompts(40)
    path = write_input(str(tmp_path / "in.parquet"), rows)
    config = make_config(model_dir, path, str(tmp_path / "out"), output={"keep_columns": ["task"]},
                         generation={"max_new_tokens": 24}, speculation={"k": "adaptive", "max_k": 3},
                         resources={"batch_size": 4, "price_per_worker_hour": 3.0}, sharding={"rows_per_shard": 10})
    job = write_yaml(config)
    assert main(["plan", job, "--sample", "10", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    summary = run_in_process(config)
    actual = summary["job"]["generated_tokens"]
    report = (tmp_path / "out" / "report.html").read_text()
    assert "Plan against the result" in report and f">{plan['predicted']['generated_tokens']}<" in report
    assert abs(plan["predicted"]["generated_tokens"] - actual) <= 0.25 * actual
    assert plan["predicted"]["output_rows"] == 40 and plan["predicted"]["generating_s"] > 0
    assert plan["predicted"]["cost"] == pytest.approx(3.0 * plan["predicted"]["generating_s"] / 3600)
    assert plan["sample"]["rows"] == 10 and plan["simulated_on"] is None
    ks = [o["k"] for o in plan["options"]]
    assert ks == [0, 1, 2, 3] and plan["options"][0]["speedup"] == 1.0
    accept = [a if a is not None else math.nan for a in plan["sample"]["accept_by_position"]]
    for option in plan["options"]:
        assert option["tokens_per_row_pass"] == pytest.approx(tokens_per_row_pass(accept, option["k"]))
    assert set(plan["recommended"]) >= {"model.drafter", "speculation.k", "resources.batch_size"}
    assert {c["category"] for c in plan["categories"]} <= {r["task"] for r in rows} and plan["categories"]
    assert [b["batch_size"] for b in plan["by_batch_size"]] == [1, 4]

    assert main(["plan", job, "--sample", "8", "--hardware", "h200"]) == 0
    text = capsys.readouterr().out
    assert f"saved: {tmp_path / 'out' / 'plan.json'}" in text
    assert "SIMULATED for h200" in text and "not a measurement" in text and "| batch size |" in text
    simulated = {}
    for shape in (None, "llama-3-8b"):
        assert main(["plan", job, "--sample", "8", "--hardware", "h200", "--json"] + (["--shape", shape] if shape else [])) == 0
        simulated[shape] = json.loads(capsys.readouterr().out)
    assert simulated[None]["simulated_shape"] == model_dir and simulated["llama-3-8b"]["simulated_shape"] == "llama-3-8b"
    tiny, big = (simulated[s]["predicted"] for s in (None, "llama-3-8b"))
    assert big["generated_tokens"] == tiny["generated_tokens"]  # lengths come from the pilot; only pass prices change
    # an 8B pass reads ~16 GB: 3.3 ms on an H200 against the fixed per-pass overhead of a tiny one
    assert big["prefill_s"] > 2 * tiny["prefill_s"] and big["generating_s"] > tiny["generating_s"]


def test_plan_fails_fast_like_run(model_dir, tmp_path, write_yaml, capsys):
    config = make_config(model_dir, str(tmp_path / "missing.parquet"), str(tmp_path / "out"))
    assert main(["plan", write_yaml(config)]) == 1
    assert "missing.parquet" in capsys.readouterr().err
    assert main(["plan", write_yaml(config), "--set", "resources.batch_size=0"]) == 2
    assert "batch_size" in capsys.readouterr().err
    assert main(["plan", write_yaml(config), "--shape", "llama-3-8b"]) == 1
    assert "--shape prices passes of another model's shape: it needs --hardware" in capsys.readouterr().err
    assert main(["plan", write_yaml(config), "--hardware", "h200", "--shape", "llama-9"]) == 1
    err = capsys.readouterr().err
    assert "--shape llama-9: no such file" in err and "llama-3-8b" in err
