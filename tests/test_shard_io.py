"""A worker's reading of one shard (exact ranges, per-row errors) and writing of its output."""

from __future__ import annotations

import io
import json
import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from workers.schemas import OUTPUT_SCHEMA, output_schema
from workers.shard_io import InputError, ShardSpec, read_shard, write_shard_output
from workers.storage import read_bytes


def jsonl_lines() -> list[bytes]:
    """Lines of very different lengths, a blank line, CRLF, and a last line without a newline."""
    lines = [json.dumps({"id": i, "prompt": "p" * (i * 37 % 200 + 1)}).encode() + b"\n" for i in range(40)]
    lines[7] = b"\n"
    lines[12] = lines[12].replace(b"\n", b"\r\n")
    lines[-1] = lines[-1].rstrip(b"\n")
    return lines


def test_parquet_range_reads_only_its_rows(tmp_path, write_input, job_config):
    records = [{"id": f"r{i}", "prompt": f"text {i}"} for i in range(30)]
    url = write_input(str(tmp_path / "in.parquet"), records, row_group_size=7)
    cfg = job_config(url).input
    rows = read_shard(ShardSpec("shard-00000", url, "parquet", 5, 17), cfg)
    assert [r.id for r in rows] == [f"r{i}" for i in range(5, 17)]
    assert rows[0].prompt == "text 5" and rows[0].messages is None and rows[0].error is None
    assert read_shard(ShardSpec("shard-00001", url, "parquet", 28, 30), cfg)[-1].id == "r29"


@pytest.mark.parametrize("step", [1, 2, 3, 5, 8, 13, 64, 200, 1000, 100_000])
def test_jsonl_byte_ranges_cover_every_line_once(tmp_path, job_config, step):
    lines = jsonl_lines()
    data = b"".join(lines)
    path = tmp_path / "in.jsonl"
    path.write_bytes(data)
    cfg = job_config(str(path)).input
    ids = []
    for start in range(0, len(data), step):
        spec = ShardSpec("s", str(path), "jsonl", start, min(start + step, len(data)))
        ids += [row.id for row in read_shard(spec, cfg)]
    assert ids == [str(i) for i in range(40) if i != 7]


def test_derived_ids_are_stable_and_non_string_ids_become_strings(tmp_path, write_input, job_config):
    parquet = write_input(str(tmp_path / "a.parquet"), [{"prompt": "x", "id": 10 + i} for i in range(3)])
    spec = ShardSpec("s", parquet, "parquet", 1, 3)
    assert [r.id for r in read_shard(spec, job_config(parquet).input)] == ["11", "12"]
    no_ids = job_config(parquet, input={"id_column": None}).input
    assert [r.id for r in read_shard(spec, no_ids)] == ["a.parquet:1", "a.parquet:2"]
    jsonl = tmp_path / "b.jsonl"
    jsonl.write_bytes(b'{"prompt": "x"}\n{"prompt": "y"}\n')
    rows = read_shard(ShardSpec("s", str(jsonl), "jsonl", 0, 32), no_ids)
    assert [r.id for r in rows] == ["b.jsonl@0", "b.jsonl@16"]


def test_bad_rows_get_errors_and_the_rest_goes_on(tmp_path, job_config):
    path = tmp_path / "mixed.jsonl"
    records = [
        b'{"id": "ok1", "prompt": "fine"}',
        b'{"id": "null", "prompt": null}',
        b'{"id": "empty", "prompt": "   "}',
        b'{"id": "number", "prompt": 5}',
        b'{"id": "noprompt"}',
        b"{not json",
        b"[1, 2]",
        b'{"prompt": "no id"}',
        b'{"id": "ok2", "prompt": "fine too"}',
    ]
    path.write_bytes(b"\n".join(records) + b"\n")
    rows = read_shard(ShardSpec("s", str(path), "jsonl", 0, path.stat().st_size), job_config(str(path)).input)
    assert [r.id for r in rows][:5] == ["ok1", "null", "empty", "number", "noprompt"]
    assert rows[0].error is None and rows[-1].error is None and rows[-1].prompt == "fine too"
    bad = rows[1:-1]
    assert all(r.error and r.error.startswith(f"{path}: line at byte ") for r in bad)
    assert "is null" in bad[0].error and "is empty" in bad[1].error and "holds int" in bad[2].error
    assert "null or missing" in bad[3].error
    bad_json_offset = sum(len(r) + 1 for r in records[:5])
    assert "not valid JSON" in bad[4].error and bad[4].id == f"mixed.jsonl@{bad_json_offset}"
    assert "not a JSON object" in bad[5].error
    assert "id column 'id' is null or missing" in bad[6].error and bad[6].prompt == "no id"


def test_bad_chat_messages_get_errors(tmp_path, write_input, job_config):
    good = [{"role": "user", "content": "hi"}]
    rows = [
        {"id": "ok", "messages": good},
        {"id": "empty", "messages": []},
        {"id": "null", "messages": None},
        {"id": "norole", "messages": [{"role": None, "content": "x"}]},
        {"id": "nocontent", "messages": [{"role": "user", "content": None}]},
    ]
    url = write_input(str(tmp_path / "chat.parquet"), rows)
    cfg = job_config(url, input={"messages_column": "messages"}).input
    got = read_shard(ShardSpec("s", url, "parquet", 0, 5), cfg)
    assert got[0].messages == good and got[0].prompt is None and got[0].error is None
    for row, why in zip(got[1:], ["an empty list", "got null", "message 0 has role NoneType", "content NoneType"]):
        assert row.error.startswith(f"{url}: row ") and why in row.error, row.error
    jsonl = tmp_path / "chat.jsonl"
    jsonl.write_text('{"id": 1, "messages": "hello"}\n{"id": 2, "messages": ["hello"]}\n')
    got = read_shard(ShardSpec("s", str(jsonl), "jsonl", 0, 100), cfg)
    assert "got str" in got[0].error and "message 0 is str" in got[1].error


def test_template_and_keep_columns(tmp_path, write_input, job_config):
    records = [{"id": 1, "text": "a cat", "lang": "en"}, {"id": 2, "lang": "fr"}, {"id": 3, "text": None}]
    url = write_input(str(tmp_path / "t.jsonl"), records)
    config = job_config(url, input={"template": "Summarize ({lang}): {text}"}, output={"keep_columns": ["lang"]})
    rows = read_shard(ShardSpec("s", url, "jsonl", 0, 1000), config.input, config.output.keep_columns)
    assert rows[0].prompt == "Summarize (en): a cat" and rows[0].keep == {"lang": "en"} and rows[0].error is None
    assert "template names missing column(s) text" in rows[1].error and rows[1].keep == {"lang": "fr"}
    assert "missing column(s) lang" in rows[2].error and rows[2].keep == {"lang": None}


def test_missing_or_mistyped_parquet_column_raises_naming_file_and_column(tmp_path, write_input, job_config):
    url = write_input(str(tmp_path / "cols.parquet"), [{"id": "1", "text": "x", "n": 3}])
    spec = ShardSpec("s", url, "parquet", 0, 1)
    with pytest.raises(InputError, match=r"cols\.parquet: no column 'prompt' \(named by input\.prompt_column\)"):
        read_shard(spec, job_config(url).input)
    with pytest.raises(InputError, match=r"no column 'lang' \(named by output\.keep_columns\)"):
        read_shard(spec, job_config(url, input={"prompt_column": "text"}).input, ["lang"])
    with pytest.raises(InputError, match=r"column 'n' is int64, not text"):
        read_shard(spec, job_config(url, input={"prompt_column": "n"}).input)


def test_reads_a_shard_from_s3(s3, s3_bucket, write_input, job_config):
    options = s3.storage_options
    url = write_input(f"{s3_bucket}/in/p.parquet", [{"id": str(i), "prompt": f"q{i}"} for i in range(10)], options, 4)
    cfg = job_config(url, input={"storage_options": options}).input
    assert [r.prompt for r in read_shard(ShardSpec("s", url, "parquet", 3, 6), cfg)] == ["q3", "q4", "q5"]
    jsonl = write_input(f"{s3_bucket}/in/p.jsonl", [{"id": str(i), "prompt": f"q{i}"} for i in range(10)], options)
    size = len(read_bytes(jsonl, options))
    specs = [ShardSpec("s", jsonl, "jsonl", start, start + 50) for start in range(0, size, 50)]
    ids = [r.id for spec in specs for r in read_shard(spec, cfg)]
    assert ids == [str(i) for i in range(10)]


def output_table(keep: pa.Field | None = None) -> pa.Table:
    row = {
        "id": "a", "sample_index": 0, "prompt": "p", "completion": "c", "completion_token_ids": [1, 2],
        "completion_tokens": 2, "finish_reason": "stop", "error": None, "seed": 7, "prompt_tokens": 3,
    }
    if keep is not None:
        row[keep.name] = "en"
    return pa.Table.from_pylist([row], schema=output_schema([keep] if keep else []))


def test_write_shard_output_locally_is_atomic(tmp_path):
    table = output_table(pa.field("lang", pa.string()))
    assert table.schema.names == OUTPUT_SCHEMA.names + ["lang"]
    url = write_shard_output(str(tmp_path / "out"), "shard-00003", table)
    assert url == str(tmp_path / "out" / "data" / "shard-00003.parquet")
    assert pq.read_table(url).equals(table)
    assert os.listdir(tmp_path / "out" / "data") == ["shard-00003.parquet"]


def test_write_shard_output_to_s3(s3, s3_bucket):
    url = write_shard_output(f"{s3_bucket}/out/run1/", "shard-00000", output_table(), s3.storage_options)
    assert url == f"{s3_bucket}/out/run1/data/shard-00000.parquet"
    assert pq.read_table(io.BytesIO(read_bytes(url, s3.storage_options))).equals(output_table())
