"""Shard planning from metadata: exact coverage, column checks before anything starts, bad files."""

from __future__ import annotations

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipeline.planner import plan_shards
from workers.shard_io import InputError, read_shard


def rows(prefix: str, n: int) -> list[dict]:
    return [{"id": f"{prefix}{i}", "prompt": f"prompt {prefix}{i}", "lang": "en"} for i in range(n)]


def read_all(plan, config) -> list[str]:
    return [row.id for spec in plan.shards for row in read_shard(spec, config.input, config.output.keep_columns)]


def test_parquet_shards_cover_every_row_once(tmp_path, write_input, job_config):
    sizes = {"a": 23, "b": 10, "c": 0, "d": 31}
    for name, n in sizes.items():
        if n:
            write_input(str(tmp_path / "in" / f"{name}.parquet"), rows(name, n), row_group_size=4)
    schema = pa.schema([("id", pa.string()), ("prompt", pa.string()), ("lang", pa.string())])
    pq.write_table(schema.empty_table(), tmp_path / "in" / "c.parquet")  # no rows, no shards
    (tmp_path / "in" / "readme.txt").write_text("ignored")
    config = job_config(str(tmp_path / "in"), sharding={"rows_per_shard": 10}, output={"keep_columns": ["lang"]})
    plan = plan_shards(config)
    assert plan.total_rows == 64 and plan.skipped_files == []
    assert [s.shard_id for s in plan.shards] == [f"shard-{i:05d}" for i in range(len(plan.shards))]
    assert [(s.url.rsplit("/", 1)[-1], s.start, s.stop) for s in plan.shards] == [
        ("a.parquet", 0, 10), ("a.parquet", 10, 20), ("a.parquet", 20, 23),
        ("b.parquet", 0, 10),
        ("d.parquet", 0, 10), ("d.parquet", 10, 20), ("d.parquet", 20, 30), ("d.parquet", 30, 31),
    ]
    assert read_all(plan, config) == [f"{name}{i}" for name, n in sizes.items() for i in range(n)]
    assert plan_shards(config) == plan  # deterministic: resume relies on it


def test_jsonl_shards_hold_about_rows_per_shard_lines_and_cover_each_once(tmp_path, write_input, job_config):
    write_input(str(tmp_path / "x.jsonl"), rows("x", 100))
    write_input(str(tmp_path / "y.json"), rows("y", 7))
    config = job_config(str(tmp_path / "*.json*"), sharding={"rows_per_shard": 25})
    plan = plan_shards(config)
    assert plan.total_rows is None and {s.kind for s in plan.shards} == {"jsonl"}
    per_shard = [len(read_shard(s, config.input)) for s in plan.shards]
    assert len(per_shard) == 5 and all(20 <= n <= 30 for n in per_shard[:4]) and per_shard[-1] == 7
    assert read_all(plan, config) == [f"x{i}" for i in range(100)] + [f"y{i}" for i in range(7)]


def test_plans_from_s3(s3, s3_bucket, write_input, job_config):
    options = s3.storage_options
    write_input(f"{s3_bucket}/in/a.parquet", rows("a", 12), options)
    write_input(f"{s3_bucket}/in/b.jsonl", rows("b", 5), options)
    config = job_config(f"{s3_bucket}/in/", input={"storage_options": options}, sharding={"rows_per_shard": 5})
    plan = plan_shards(config)
    assert [s.url for s in plan.shards][:3] == [f"{s3_bucket}/in/a.parquet"] * 3
    assert read_all(plan, config) == [f"a{i}" for i in range(12)] + [f"b{i}" for i in range(5)]


def test_no_input_files_names_the_path(tmp_path, job_config):
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(InputError, match=f"{tmp_path}: no input files there"):
        plan_shards(job_config(str(tmp_path)))


def test_missing_and_mistyped_columns_stop_before_anything_starts(tmp_path, write_input, job_config):
    write_input(str(tmp_path / "ok.parquet"), rows("a", 3))
    bad = write_input(str(tmp_path / "zz.parquet"), [{"id": "1", "text": "x", "n": 1}])
    with pytest.raises(InputError, match=rf"{bad}: no column 'prompt' \(named by input.prompt_column\)"):
        plan_shards(job_config(str(tmp_path)))
    with pytest.raises(InputError, match=r"no column 'id_x' \(named by input.id_column; set it to null to derive"):
        plan_shards(job_config(bad, input={"prompt_column": "text", "id_column": "id_x"}))
    with pytest.raises(InputError, match=r"zz.parquet: column 'n' is int64, not text"):
        plan_shards(job_config(bad, input={"prompt_column": "n"}))
    with pytest.raises(InputError, match=r"no column 'body' \(named by input.template\)"):
        plan_shards(job_config(bad, input={"template": "{text} {body}"}))
    jsonl = write_input(str(tmp_path / "c.jsonl"), [{"text": "x"}])
    with pytest.raises(InputError, match=rf"{jsonl}: no column 'prompt'.*no column 'id'"):
        plan_shards(job_config(jsonl))


@pytest.mark.parametrize(
    ("name", "content"), [("bad.parquet", b"not parquet at all"), ("bad.jsonl", b"a,b,c\n1,2,3\n")]
)
def test_corrupt_file_fails_or_is_skipped(tmp_path, write_input, job_config, name, content):
    write_input(str(tmp_path / "good.parquet"), rows("g", 3))
    (tmp_path / name).write_bytes(content)
    with pytest.raises(InputError, match=rf"{tmp_path / name}: .*on_bad_file: skip"):
        plan_shards(job_config(str(tmp_path)))
    config = job_config(str(tmp_path), input={"on_bad_file": "skip"})
    plan = plan_shards(config)
    assert [f.url for f in plan.skipped_files] == [str(tmp_path / name)] and plan.skipped_files[0].reason
    assert read_all(plan, config) == ["g0", "g1", "g2"]
