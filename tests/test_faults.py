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
ENV = {**os.environ, "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0"}


def _kill_session(proc: subprocess.Popen) -> None:
    """SIGKILL the driver and every process of the session it started (its local Ray included)."""
    session = proc.pid  # started with start_new_session: it leads its own session and group
    try:
        os.killpg(session, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()
    for other in psutil.process_iter(["pid"]):
        try:
            if os.getsid(other.pid) == session:
                other.kill()
        except (ProcessLookupError, psutil.NoSuchProcess, PermissionError):
            pass


def _slow_job(model_dir: str, tmp_path, write_input, write_yaml) -> tuple[list[str], object]:
    """A CLI command for a 16-row job slow enough to interrupt, and its output folder."""
    path = write_input(str(tmp_path / "in.jsonl"), prompts(16))
    out = tmp_path / "out"
    config = write_yaml({
        "name": "resume", "input": {"path": path}, "output": {"path": str(out)}, "model": {"target": model_dir},
        "generation": {"max_new_tokens": 48}, "speculation": {"k": 0},
        "resources": {"cpus_per_worker": 0.5, "batch_size": 1}, "sharding": {"rows_per_shard": 2}})
    return [sys.executable, "-m", "jobs.cli", "run", config, "--quiet", "--json"], out


def _default_sigint() -> None:
    """In the child before exec: Ctrl-C's default action, as in a terminal. A suite started in the background
    (`make test &`, nohup) ignores SIGINT, the child would inherit that, and Python then installs no
    KeyboardInterrupt handler."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def _start_and_wait_for_commits(command: list[str], out, commits: int = 2) -> subprocess.Popen:
    proc = subprocess.Popen(command, env=ENV, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            preexec_fn=_default_sigint)
    deadline = time.time() + 120
    while time.time() < deadline and len(list((out / "stats" / "parts").glob("*.json"))) < commits:
        assert proc.poll() is None, "the run ended before it could be interrupted"
        time.sleep(0.1)
    return proc


def _resume_and_check(command: list[str], out, model_dir: str, committed: set[str]) -> None:
    """Rerun the same command: committed shards are skipped, nothing partial shows, every row once."""
    second = subprocess.run(command, env=ENV, capture_output=True, text=True, timeout=240)
    assert second.returncode == 0, second.stderr[-2000:]
    summary = json.loads(second.stdout)
    assert summary["this_run"]["shards_resumed"] >= len(committed) and summary["job"]["shards"] == 8
    assert not [p for p in out.rglob("*") if p.name.startswith(".")], "a partial file of the killed run is visible"
    assert_exactly_once(make_config(model_dir, str(out.parent / "in.jsonl"), str(out)), [f"p{i}" for i in range(16)])


def test_ctrl_c_stops_cleanly_and_the_rerun_resumes(model_dir, tmp_path, write_input, write_yaml):
    command, out = _slow_job(model_dir, tmp_path, write_input, write_yaml)
    proc = _start_and_wait_for_commits(command, out)
    os.kill(proc.pid, signal.SIGINT)
    try:
        _, stderr = proc.communicate(timeout=60)
    finally:
        _kill_session(proc)
    assert proc.returncode == 130 and "resume" in stderr.decode()
    assert not (out / "_SUCCESS").exists() and not (out / "_LEASE.json").exists()
    _resume_and_check(command, out, model_dir, {p.stem for p in (out / "stats" / "parts").glob("*.json")})


def test_killed_driver_resumes_without_regenerating(model_dir, tmp_path, write_input, write_yaml):
    command, out = _slow_job(model_dir, tmp_path, write_input, write_yaml)
    first = _start_and_wait_for_commits(command, out)
    _kill_session(first)
    committed = {p.stem for p in (out / "stats" / "parts").glob("*.json")}
    assert committed and not (out / "_SUCCESS").exists()
    _resume_and_check(command, out, model_dir, committed)


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
    assert outage["stopped"] < summary["job"]["finished_at"], "the job ended before the outage began"
    assert summary["job"]["shards"] == 8
    assert_exactly_once(config, [f"p{i}" for i in range(16)])
