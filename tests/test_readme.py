"""The README's examples run, the way doctest runs a docstring's.

Every fenced block tagged `python` or `bash` in README.md runs against a tiny finished job; a block that
cannot run here (it needs a cluster, object storage, or minutes of installing) says so on the line before
its fence, as `<!-- readme-test: skip (reason) -->`, and is reported as skipped with that reason. Untagged
blocks are output samples, file trees and synopses: not run. Python blocks run with `OUTPUT` (the job's
output path) defined; bash blocks with `$OUTPUT` set and `specbatch` on PATH meaning this checkout's CLI.
A block may import a package specbatch does not depend on (`datasets`): without it, the block is skipped.
"""
from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.pipeline_helpers import make_config, prompts, run_in_process

REPO = Path(__file__).resolve().parents[1]
FENCE = re.compile(r"^(?:<!-- readme-test: skip \((?P<skip>[^)]*)\) -->\n)?```(?P<lang>python|bash)\n(?P<code>.*?)^```$",
                   re.M | re.S)
OPTIONAL_PACKAGES = {"datasets"}


def blocks() -> list:
    readme = (REPO / "README.md").read_text()
    found = []
    for match in FENCE.finditer(readme):
        line = readme.count("\n", 0, match.start("code"))
        marks = [pytest.mark.skip(reason=match["skip"])] if match["skip"] else []
        found.append(pytest.param(match["lang"], match["code"], marks=marks, id=f"{match['lang']}-line{line}"))
    return found


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory, model_dir) -> str:
    """A tiny job run to the end (no Ray: the README's reading examples only need its output)."""
    root = tmp_path_factory.mktemp("readme")
    source = root / "in.jsonl"
    source.write_text("".join(json.dumps(row) + "\n" for row in prompts(6)))
    config = make_config(model_dir, str(source), str(root / "out"), output={"keep_columns": ["task"]})
    run_in_process(config)
    return config.output.path


def test_the_readme_marks_the_blocks_it_cannot_run():
    params = blocks()
    assert len(params) >= 5 and any(not p.marks for p in params) and any(p.marks for p in params)


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lang, code", blocks())
def test_readme_block_runs(lang, code, finished_job, tmp_path, monkeypatch):
    if lang == "python":
        monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "hf"))  # where `datasets` is installed: not ~/.cache
        out = io.StringIO()
        try:
            with contextlib.redirect_stdout(out):
                exec(compile(code, "README.md", "exec"), {"OUTPUT": finished_job})
        except ModuleNotFoundError as exc:
            if exc.name not in OPTIONAL_PACKAGES:
                raise
            pytest.skip(f"the example uses {exc.name}, which is not installed here")
        assert out.getvalue().strip(), "the example printed nothing"
        return
    shim = tmp_path / "bin" / "specbatch"
    shim.parent.mkdir()
    shim.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m jobs.cli "$@"\n')
    shim.chmod(0o755)
    env = {**os.environ, "OUTPUT": finished_job, "PYTHONPATH": str(REPO), "PATH": f"{shim.parent}:{os.environ['PATH']}"}
    done = subprocess.run(["bash", "-euo", "pipefail", "-c", code], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=50)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip(), "the example printed nothing"
