"""Reading a job's output back: `specbatch show`, and the data files as one Arrow dataset, locally and on S3."""
from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.dataset as ds
import pytest

from jobs.cli import main
from tests.pipeline_helpers import make_config, prompts, run_in_process
from workers.storage import filesystem

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def test_show_prints_the_figures_and_a_few_completions_and_the_data_reads_as_one_dataset(
        model_dir, tmp_path, write_input, monkeypatch, capsys):
    rows = prompts(6)
    rows[5]["task"] = None  # the last shard's kept column is all null: it still takes the file's type
    path = write_input(str(tmp_path / "in.parquet"), rows)
    config = make_config(model_dir, path, str(tmp_path / "out"), output={"keep_columns": ["task"]},
                         sharding={"rows_per_shard": 5})
    summary = run_in_process(config)
    data = ds.dataset(str(tmp_path / "out" / "data"))
    assert data.schema.field("task").type == pa.string() and data.count_rows() == 6
    assert sorted(p.name for p in (tmp_path / "out" / "data").iterdir()) == ["shard-00000.parquet", "shard-00001.parquet"]

    monkeypatch.chdir(tmp_path)
    assert main(["show", "out", "--rows", "2"]) == 0
    shown = capsys.readouterr().out.splitlines()
    assert shown[0] == "t: finished" and shown[1].startswith(f"job: 6 rows (0 failed), {summary['job']['generated_tokens']} tokens")
    assert f"output: {tmp_path / 'out'}" in shown and f"report: {tmp_path / 'out'}/report.html" in shown
    heads = [line for line in shown if line.startswith("── ")]
    assert len(heads) == 2 and heads[0].startswith("── p0 · sample 0 · ")
    assert "prompt: the quick brown fox 0" in shown and sum(line.startswith("completion: ") for line in shown) == 2
    assert main(["show", "nowhere"]) == 1
    assert f"error: {tmp_path / 'nowhere'} holds no specbatch job" in capsys.readouterr().err


def test_show_and_the_dataset_work_on_s3(model_dir, s3, s3_bucket, write_input, monkeypatch, capsys):
    opts = s3.storage_options
    path = write_input(f"{s3_bucket}/in.jsonl", prompts(3), opts)
    out = f"{s3_bucket}/out"
    run_in_process(make_config(model_dir, path, out, input={"storage_options": opts}, output={"storage_options": opts}))
    fs, root = filesystem(out, opts)
    assert ds.dataset(f"{root}/data", filesystem=fs).count_rows() == 3
    monkeypatch.setenv("AWS_ENDPOINT_URL", s3.endpoint_url)  # `show` takes credentials from the environment,
    type(fs).clear_instance_cache()  # which a client cached by an earlier test (no endpoint, no keys) ignores
    assert main(["show", out, "--rows", "1"]) == 0
    shown = capsys.readouterr().out
    assert shown.startswith("t: finished\njob: 3 rows") and shown.count("── ") == 1 and f"output: {out}" in shown
    assert json.loads(fs.cat_file(f"{root}/summary.json"))["noise"]["limit"] == 3.0
