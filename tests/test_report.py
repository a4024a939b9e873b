"""The job report: built from an output folder alone, for a running or a finished job, and shown by a real browser."""
from __future__ import annotations

import re
import shutil
import subprocess
import tempfile
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from jobs.cli import main
from pipeline.job_state import JobState
from pipeline.report import build_report
from pipeline.summary import RunInfo, summarize, write_closing_files
from tests.pipeline_helpers import make_config, shard
from workers.schemas import ShardStats, output_schema
from workers.storage import Store

CHROMIUM = shutil.which("chromium")
CHARTS = 4  # throughput over time, tokens/s per shard, acceptance by position, k histogram


def write_shard(store: Store, stats: ShardStats) -> None:
    """A committed shard as a worker leaves it: its data file (with a kept `task` column), then its stats part."""
    reasons = ["stop"] * stats.stop_rows + ["length"] * stats.length_rows + ["error"] * stats.failed_rows
    rows = [{"id": f"{stats.shard_id}/{n}", "sample_index": 0, "prompt": f"tell me <{n}>",
             "completion": None if r == "error" else f"<b>{stats.shard_id}</b> & co",
             "completion_token_ids": [], "completion_tokens": 0, "finish_reason": r,
             "error": f"bad <row> of {stats.shard_id}" if r == "error" else None, "seed": n, "prompt_tokens": 3,
             "task": f"task-{n % 2}"}
            for n, r in enumerate(reasons)]
    sink = pa.BufferOutputStream()
    pq.write_table(pa.Table.from_pylist(rows, schema=output_schema([pa.field("task", pa.string())])), sink)
    store.write(sink.getvalue().to_pybytes(), "data", f"{stats.shard_id}.parquet")
    store.write_json(stats.to_dict(), "stats", "parts", f"{stats.shard_id}.json")


@pytest.fixture
def running_job(tmp_path, model_dir):
    """A job mid-run: one shard resumed from an earlier run, four from this one (one failed row, one retry, one
    whose target passes took 4x as long: a busy machine)."""
    config = make_config(model_dir, str(tmp_path / "in.jsonl"), str(tmp_path / "out"),
                         input={"storage_options": {"secret": "hunter2"}})
    state = JobState(config)
    state.claim(overwrite=False, planned_shards=6)
    stats = [shard(0, "worker-000", "earlier-run")]
    stats += [shard(i, f"worker-00{i % 2}", state.run_id, failed=int(i == 3), attempt=1 + (i == 2)) for i in range(1, 5)]
    stats[4].verify_s *= 4
    for s in stats[1:]:
        s.ray_node_id = f"ray-node-{s.worker_id}"
    for s in stats:
        write_shard(state.store, s)
    state.record_retry("shard-00002", 1, "worker-000", "worker died: <ActorDiedError>")
    return state, stats


def test_report_of_a_running_job_then_of_the_finished_one(running_job):
    state, stats = running_job
    html = build_report(state.store)
    assert 'class="status running"' in html and "5 of 6" in html
    assert html.count("<svg") == CHARTS and "worker-000" in html and "worker-001" in html
    assert "drafter <b>ngram</b>" in html and "acceptance by draft position (ngram)" in html
    assert "bad &lt;row&gt; of shard-00003" in html  # the failed row's error, escaped
    assert "worker died: &lt;ActorDiedError&gt;" in html and "1 of 5 committed shards were made by earlier runs" in html
    assert "hunter2" not in html and "***" in html  # the config, redacted
    assert not re.search(r"""(src|href)\s*=|url\(|@import""", html), "the report must not load anything"
    assert html.count("a loaded or throttled machine, not the job") == 2  # at the top and by the pass times
    assert "shard-00004 400.0 ms" in html and "<td>shard-00004</td><td>worker-000</td>" in html
    assert "ray-node-worker-000" in html and "ray-node-worker-001" in html and "<td>–</td>" not in html
    samples = html[html.index("<h2>Sample completions</h2>"):html.index("<h2>Runs")]
    assert samples.count("<td>task-0</td>") == samples.count("<td>task-1</td>") == 3
    assert "tell me &lt;0&gt;" in samples and "&lt;b&gt;shard-00000&lt;/b&gt; &amp; co" in samples
    assert "<b>shard" not in html and "<script" not in html
    run = RunInfo(state.run_id, state.started, 10.0, 4)
    write_closing_files(state.store, stats, summarize(stats, run, state.store.root))
    state.release()
    assert main(["report", state.store.root]) == 0
    finished = (Path(state.store.root) / "report.html").read_text()
    assert 'class="status finished"' in finished and "bad &lt;row&gt; of shard-00003" in finished


def test_report_of_a_folder_without_a_job_is_a_clear_error(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) == 1
    assert "holds no specbatch job" in capsys.readouterr().err


def chromium(url: str, *args: str) -> subprocess.CompletedProcess:
    """Headless Chromium on a fresh profile, nothing fetched in the background; console messages on stderr."""
    profile = tempfile.mkdtemp(prefix="sbchrome-")
    try:
        return subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
                               "--disable-component-update", "--disable-sync", "--no-first-run", "--hide-scrollbars",
                               f"--user-data-dir={profile}", "--enable-logging=stderr", "--v=0", *args, url],
                              capture_output=True, text=True, timeout=90)
    finally:
        shutil.rmtree(profile, ignore_errors=True)


def console_messages(run: subprocess.CompletedProcess) -> list[str]:
    return [line for line in run.stderr.splitlines() if ":CONSOLE" in line]


@pytest.mark.skipif(CHROMIUM is None, reason="no chromium on PATH: apt-get install chromium (.ci/run does)")
@pytest.mark.timeout(240)
def test_the_report_renders_in_chromium_with_its_charts_and_no_console_errors(running_job, tmp_path):
    state, _ = running_job
    page = tmp_path / "report.html"
    page.write_text(build_report(state.store))
    # The oracle first: a page that logs an error is caught this way.
    broken = tmp_path / "broken.html"
    broken.write_text('<html><body><script>console.error("sb-probe")</script></body></html>')
    assert any("sb-probe" in m for m in console_messages(chromium(broken.as_uri(), "--dump-dom")))

    dom = chromium(page.as_uri(), "--dump-dom")
    assert dom.returncode == 0 and console_messages(dom) == []
    for section in ("Time per target pass", "Sample completions", "a loaded or throttled machine", "ray-node-worker-001"):
        assert section in dom.stdout
    assert "&lt;b&gt;shard-00000&lt;/b&gt; &amp; co" in dom.stdout and "<b>shard-" not in dom.stdout  # text, not markup
    charts = re.findall(r"<svg.*?</svg>", dom.stdout, flags=re.S)
    assert len(charts) == CHARTS and all(("<rect" in c or "<polyline" in c) and "<text" in c for c in charts)
    shot = tmp_path / "report.png"
    run = chromium(page.as_uri(), f"--screenshot={shot}", "--window-size=1100,2600")
    assert run.returncode == 0 and console_messages(run) == []
    png = shot.read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and int.from_bytes(png[16:20], "big") == 1100 and len(png) > 20_000
