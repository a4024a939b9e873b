"""A wheel of this repo holds every module and kernel source: Ray workers on a cluster may run from an installed
package rather than the repo, and a package missing workers.engine (or its C sources) fails there, or decodes on
torch's slower kernels without a word."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.timeout(180)
def test_the_wheel_holds_every_module_and_kernel_source(tmp_path):
    pytest.importorskip("setuptools", reason="builds without isolation: needs setuptools in this environment")
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, check=True, capture_output=True, text=True).stdout.split()
    source = tmp_path / "src"   # the tracked files alone: no build/ folder of an earlier build can fill the gaps
    for name in tracked:
        if (ROOT / name).is_file():
            (source / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, source / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", str(source), "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path / "wheel")], check=True, capture_output=True, timeout=170)
    names = set(zipfile.ZipFile(next((tmp_path / "wheel").glob("*.whl"))).namelist())
    needed = [f for f in tracked if f.split("/")[0] in ("pipeline", "workers", "jobs") and f.endswith((".py", ".c", ".h"))]
    assert any(f.startswith("workers/engine/csrc/") for f in needed)
    assert [f for f in needed if f not in names] == []
