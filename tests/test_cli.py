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

from tests.pipeline_helpers import prompts

REPO = Path(__file__).resolve().parents[1]


def specbatch(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    """Run `python -m jobs.cli ARGS` from this checkout in a new process."""
    base = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "RAY_AUTH_MODE")}
    base["PYTHONPATH"] = str(REPO)
    return subprocess.run([sys.executable, "-m", "jobs.cli", *args], env={**base, **(env or {})},
                          capture_output=True, text=True, timeout=timeout, cwd=REPO)


@pytest.mark.timeout(300)
def test_local_run_ignores_a_stale_ray_current_cluster(model_dir, tmp_path, write_input):
    """A `ray start` killed long ago leaves /tmp/ray/ray_current_cluster behind; a local run starts its own Ray."""
    ray_tmp = tempfile.mkdtemp(prefix="sbstale-", dir="/tmp")  # short: Ray's unix sockets live under it
    (Path(ray_tmp) / "ray").mkdir()
    (Path(ray_tmp) / "ray" / "ray_current_cluster").write_text("127.0.0.1:1\n")
    path = write_input(str(tmp_path / "in.jsonl"), prompts(4))
    config = tmp_path / "job.yaml"
    config.write_text(f"input: {{path: {path}}}\noutput: {{path: {tmp_path / 'out'}}}\nmodel: {{target: {model_dir}}}\n"
                      "generation: {max_new_tokens: 4}\nresources: {cpus_per_worker: 0.5, batch_size: 4}\n")
    try:
        done = specbatch("run", str(config), "--quiet", "--json", env={"RAY_TMPDIR": ray_tmp}, timeout=240)
    finally:
        shutil.rmtree(ray_tmp, ignore_errors=True)
    assert done.returncode == 0, done.stderr[-3000:]
    assert json.loads(done.stdout)["rows"] == 4
    assert "Traceback" not in done.stderr
