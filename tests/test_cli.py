"""The `specbatch` command as a user meets it: a fresh process, its exit code, what it prints."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from jobs.cli import main
from tests.pipeline_helpers import prompts

REPO = Path(__file__).resolve().parents[1]


def specbatch(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m jobs.cli ARGS` from this checkout in a new process."""
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    base["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.timeout(300)
def test_local_run_ignores_a_stale_ray_current_cluster_and_is_quiet(model_dir, tmp_path, write_input, write_yaml):
    """A `ray start` killed long ago leaves /tmp/ray/ray_current_cluster behind; a local run starts its own Ray."""
    ray_tmp = tempfile.mkdtemp(prefix="sbstale-", dir="/tmp")  # short: Ray's unix sockets live under it
    (Path(ray_tmp) / "ray").mkdir()
    (Path(ray_tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    path = write_input(str(tmp_path / "in.jsonl"), prompts(4))
    config = write_yaml({"input": {"path": path}, "output": {"path": str(tmp_path / "out")}, "model": {"target": model_dir},
                         "generation": {"max_new_tokens": 4}, "resources": {"cpus_per_worker": 0.5, "batch_size": 4}})
    try:
        done = specbatch("run", config, "--quiet", "--json", env={"RAY_TMPDIR": ray_tmp}, timeout=240)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["job"]["rows"] == 4
    assert done.stderr == ""  # --quiet: no Ray banner or token warning, no worker progress bars


def refused_before_heavy_imports(*args: str) -> tuple[int, str]:
    """Run the CLI in a fresh process; return its exit code and stderr, checking torch and Ray were never imported."""
    probe = ("import sys; from jobs.cli import main; code = main(sys.argv[1:]); "
             "heavy = [m for m in ('torch', 'ray', 'transformers') if m in sys.modules]; "
             "print(code, heavy); sys.exit(0)")
    done = subprocess.run([sys.executable, "-c", probe, *args], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    code, heavy = done.stdout.split(" ", 1)
    assert heavy.strip() == "[]", f"imported {heavy} before refusing"
    return int(code), done.stderr


def test_bad_configs_and_inputs_are_refused_before_torch_and_ray_load(tmp_path, model_dir, write_yaml):
    config = write_yaml({"input": {"path": str(tmp_path / "missing.jsonl")}, "output": {"path": str(tmp_path / "o")},
                         "model": {"target": model_dir}})
    code, err = refused_before_heavy_imports("run", config, "--set", "generaton.max_new_tokens=3")
    assert code == 2 and "generaton (from --set): unknown key; did you mean generation?" in err
    code, err = refused_before_heavy_imports("run", str(tmp_path / "nope.yaml"))
    assert code == 2 and "no such config file" in err
    code, err = refused_before_heavy_imports("run", config)
    assert code == 1 and "missing.jsonl: no input files there" in err
    code, err = refused_before_heavy_imports("run", config, "--set", f"model.target={tmp_path / 'gone'}")
    assert code == 1 and "error: model path" in err and "gone" in err
    (tmp_path / "in.jsonl").write_text('{"id": 1, "prompt": "hi"}\n')
    (tmp_path / "o").mkdir()
    (tmp_path / "o" / "_job.json").write_text(json.dumps({"fingerprint": "another job", "config": {}}))
    code, err = refused_before_heavy_imports("run", config, "--set", f"input.path={tmp_path / 'in.jsonl'}")
    assert code == 1 and "holds the output of a different config" in err


def test_the_driver_plans_and_names_its_workers_without_torch_or_transformers(tmp_path, model_dir, write_input,
                                                                              write_yaml):
    """The driver side (CLI, config, planning, output checks, the driver module and its actor class) starts
    without torch and transformers; only the workers load them."""
    path = write_input(str(tmp_path / "in.parquet"), prompts(3))
    config = write_yaml({"input": {"path": path}, "output": {"path": str(tmp_path / "o")}, "model": {"target": model_dir}})
    probe = ("import sys, ray; import jobs.cli; from pipeline.config_file import load_config; "
             "from pipeline.planner import plan_job; from pipeline.job_state import JobState; "
             "from pipeline.driver import WorkerPool, worker_shape; from workers.actor import GenerationWorker; "
             "config = load_config(sys.argv[1]); plan = plan_job(config); JobState(config).check(False); "
             "worker_shape(config, {'CPU': 2.0}); ray.remote(GenerationWorker); "
             "print(len(plan.shards), [m for m in ('torch', 'transformers') if m in sys.modules])")
    done = subprocess.run([sys.executable, "-c", probe, config], env={**os.environ, "PYTHONPATH": str(REPO)},
                          capture_output=True, text=True, timeout=60, cwd=REPO)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["1", "[]"]


def test_every_printed_path_is_absolute_and_greedy_samples_are_warned_about(tmp_path, model_dir, write_yaml,
                                                                            monkeypatch, capsys):
    config = write_yaml({"input": {"path": "in.jsonl"}, "output": {"path": "o"}, "model": {"target": model_dir}})
    monkeypatch.chdir(tmp_path)
    code = main(["run", config, "--set", "input.path=rel/missing.jsonl", "--set", "generation.samples_per_prompt=3"])
    err = capsys.readouterr().err.splitlines()
    assert code == 1 and err[0].startswith("warning: generation.samples_per_prompt is 3 but generation.temperature is 0")
    assert err[1] == f"error: {tmp_path / 'rel' / 'missing.jsonl'}: no input files there (looked for .parquet, .jsonl, .json)"
    assert main(["report", "rel"]) == 1
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'rel'} holds no specbatch job")


def test_the_progress_bar_counts_shards_and_notes_output_rows():
    from pipeline.driver import progress_note

    assert progress_note(48, 600, 12.0) == "48 rows out, 50.0 tokens/s"
    assert progress_note(0, 0, 0.0) == "0 rows out, 0.0 tokens/s"


def test_version(capsys):
    with pytest.raises(SystemExit) as done:
        main(["--version"])
    assert done.value.code == 0 and capsys.readouterr().out.startswith("specbatch ")


def test_config_errors_name_every_bad_key_and_no_secret(write_yaml, capsys):
    config_file = write_yaml({"input": {"path": "x.jsonl", "storage_options": {"secret": "hunter2"}},
                              "output": {"path": "o"}, "model": {"target": "m", "drafter": "magic"},
                              "generation": {"temperature": -1, "max_new_tokens": 0}, "speculaton": {"k": 2}})
    code = main(["run", config_file, "--set", "resources.batch_size=zero", "--set", "sharding.rows=3"])
    err = capsys.readouterr().err
    assert code == 2
    for key in ("model.drafter", "generation.temperature", "generation.max_new_tokens", "speculaton",
                "resources.batch_size (from --set)", "sharding.rows (from --set)"):
        assert key in err
    assert "hunter2" not in err


def test_a_missing_column_is_named_without_a_traceback(model_dir, tmp_path, write_input, write_yaml, capsys):
    path = write_input(str(tmp_path / "in.parquet"), prompts(2))
    config_file = write_yaml({"input": {"path": path}, "output": {"path": str(tmp_path / "o")}, "model": {"target": model_dir}})
    assert main(["run", config_file, "--set", "input.prompt_column=text"]) == 1
    err = capsys.readouterr().err
    assert "in.parquet" in err and "text" in err and "Traceback" not in err
