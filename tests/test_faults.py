"""Fault injection with real processes: a killed driver resumes, an S3 outage mid-job loses nothing."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import psutil
import pytest

from pipeline.driver import run_job
from tests.pipeline_helpers import assert_exactly_once, make_config, prompts
from workers.storage import list_files

pytestmark = pytest.mark.timeout(300)


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and every process of the session it started (its local Ray included)."""
    session = os.getsid(proc.pid)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for other in psutil.process_iter(["pid"]):
        try:
            if os.getsid(other.pid) == session:
                other.kill()
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass


def test_killed_driver_resumes_without_regenerating(model_dir, tmp_path, write_input):
    path = write_input(str(tmp_path / "in.jsonl"), prompts(16))
    config = tmp_path / "job.yaml"
    out = tmp_path / "out"
    config.write_text(json.dumps({
        "name": "resume", "input": {"path": path}, "output": {"path": str(out)}, "model": {"target": model_dir},
        "generation": {"max_new_tokens": 48}, "speculation": {"k": 0},
        "resources": {"cpus_per_worker": 0.5, "batch_size": 1}, "sharding": {"rows_per_shard": 2}}))
    command = [sys.executable, "-m", "jobs.cli", "run", str(config), "--quiet", "--json"]
    env = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}
    first = subprocess.Popen(command, env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.time() + 120
        while time.time() < deadline and len(list((out / "stats" / "parts").glob("*.json"))) < 2:
            assert first.poll() is None, "the first run ended before it could be killed"
            time.sleep(0.1)
    finally:
        _kill_session(first)
    committed = {p.stem for p in (out / "stats" / "parts").glob("*.json")}
    assert committed and not (out / "_SUCCESS").exists()
    second = subprocess.run(command, env=env, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout)
    assert summary["shards_skipped"] >= len(committed) and summary["shards"] == 8
    assert not [p for p in out.rglob("*") if p.name.startswith(".")], "a partial file of the killed run is visible"
    cfg = make_config(model_dir, path, str(out))
    assert_exactly_once(cfg, [f"p{i}" for i in range(16)])


@pytest.mark.usefixtures("local_ray")
def test_s3_outage_mid_job_is_retried_and_loses_nothing(model_dir, restartable_s3, write_input):
    s3 = restartable_s3
    bucket = s3.make_bucket()
    opts = s3.storage_options
    write_input(f"{bucket}/in/p.jsonl", prompts(16), opts)
    config = make_config(model_dir, f"{bucket}/in/p.jsonl", f"{bucket}/out/", input={"storage_options": opts},
                         output={"storage_options": opts}, generation={"max_new_tokens": 24},
                         sharding={"rows_per_shard": 2}, resources={"batch_size": 1})
    outage = {}

    def interrupt():
        deadline = time.time() + 60
        while time.time() < deadline:
            try:
                if list_files(f"{bucket}/out/data/", opts):
                    break
            except Exception:
                pass
            time.sleep(0.1)
        s3.stop()
        outage["stopped"] = time.time()
        time.sleep(2.0)
        s3.start()
        outage["restarted"] = time.time()

    thread = threading.Thread(target=interrupt)
    thread.start()
    summary = run_job(config, progress=False)
    thread.join()
    assert "restarted" in outage
    assert summary["shards"] == 8
    assert_exactly_once(config, [f"p{i}" for i in range(16)])
