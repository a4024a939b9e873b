"""A shard's rows in and its generations out, read and written by the worker itself.

Prompts never pass through the driver: the planner hands out ShardSpecs (a file and a range) and
the worker reads exactly its range from storage. A Parquet range is rows [start, stop); a JSONL
range is bytes [start, stop) and holds the lines that START inside it (like Hadoop splits), so
consecutive ranges never overlap and never miss a line, whatever the line lengths.

Problems with one row become an InputRow with `error` set, so the rest of the shard goes on;
problems with a whole file (a missing column, a wrong column type) raise InputError.
Duplicate ids are the workers' business within a shard; across shards the driver will compare
per-shard id hashes (not built here).
"""

from __future__ import annotations

import json
import posixpath
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from workers.config import InputConfig, template_fields
from workers.storage import join, on_storage, safe_url, write_bytes_atomic

class InputError(ValueError):
    """The input cannot be used as configured; the message names the file and the column."""


@dataclass(frozen=True)
class ShardSpec:
    """One unit of work: rows [start, stop) of a Parquet file, or the JSONL lines starting in bytes [start, stop)."""

    shard_id: str
    url: str
    kind: Literal["parquet", "jsonl"]
    start: int
    stop: int


@dataclass
class InputRow:
    """One prompt: plain text (prompt) or chat (messages); error says why the row cannot be generated."""

    id: str
    prompt: str | None
    messages: list[dict[str, str]] | None
    keep: dict[str, Any] = field(default_factory=dict)
    error: str | None = None


class _BadRow(ValueError):
    """A problem confined to one row."""


def check_columns(
    columns: Mapping[str, pa.DataType | None], url: str, cfg: InputConfig, keep_columns: Sequence[str] = ()
) -> None:
    """Raise InputError naming the file and every missing or wrongly typed column.

    `columns` maps each column name to its Arrow type, or to None where the type is not known
    (JSONL, where values are checked row by row instead).
    """
    problems = [
        f"no column '{c}' (named by {key}{'; set it to null to derive ids' if key == 'input.id_column' else ''})"
        for c, key in _column_sources(cfg, keep_columns)
        if c not in columns
    ]
    if cfg.prompt_column in columns and not _is_text(columns[cfg.prompt_column]):
        problems.append(f"column '{cfg.prompt_column}' is {columns[cfg.prompt_column]}, not text")
    if cfg.messages_column in columns and not _is_messages(columns[cfg.messages_column]):
        problems.append(
            f"column '{cfg.messages_column}' is {columns[cfg.messages_column]}, not a list of {{role, content}}"
        )
    if problems:
        raise InputError(f"{safe_url(url)}: " + "; ".join(problems))


def _is_text(t: pa.DataType | None) -> bool:
    if t is None or pa.types.is_null(t):
        return True
    if pa.types.is_dictionary(t):
        return _is_text(t.value_type)
    return pa.types.is_string(t) or pa.types.is_large_string(t) or pa.types.is_string_view(t)


def _is_messages(t: pa.DataType | None) -> bool:
    if t is None or pa.types.is_null(t):
        return True
    if not (pa.types.is_list(t) or pa.types.is_large_list(t)) or not pa.types.is_struct(t.value_type):
        return False
    fields = {f.name: f.type for f in t.value_type}
    return all(name in fields and _is_text(fields[name]) for name in ("role", "content"))


def read_shard(spec: ShardSpec, cfg: InputConfig, keep_columns: Sequence[str] = ()) -> list[InputRow]:
    """The shard's rows, read straight from storage (with retries)."""
    name = posixpath.basename(spec.url.rstrip("/"))
    shown = safe_url(spec.url)
    if spec.kind == "parquet":
        records = on_storage(
            spec.url, cfg.storage_options, lambda fs, path: _parquet_records(fs, path, spec, cfg, keep_columns), "read"
        )
        return [
            _to_row(record, f"{shown}: row {i}", f"{name}:{i}", cfg, keep_columns)
            for i, record in enumerate(records, start=spec.start)
        ]
    rows = []
    lines = on_storage(spec.url, cfg.storage_options, lambda fs, path: jsonl_lines(fs, path, spec), "read")
    for offset, line in lines:
        if line.strip():
            rows.append(_jsonl_row(line, f"{shown}: line at byte {offset}", f"{name}@{offset}", cfg, keep_columns))
    return rows


def declared_types(spec: ShardSpec, cfg: InputConfig) -> dict[str, pa.DataType]:
    """The column types the shard's file declares: a Parquet footer's, so that every shard of the file writes
    its kept columns with one type (a shard whose values are all null would otherwise write type null, and
    the output's data files would not read as one dataset). JSONL declares none."""
    if spec.kind != "parquet":
        return {}
    schema = on_storage(spec.url, cfg.storage_options, lambda fs, path: pq.read_schema(path, filesystem=fs), "read")
    return {f.name: f.type for f in schema}


def _column_sources(cfg: InputConfig, keep_columns: Sequence[str]) -> list[tuple[str, str]]:
    """(column, the config key that names it) for every column a shard reads."""
    sources = [(c, "input.template") for c in template_fields(cfg.template)] if cfg.template else []
    for key in ("prompt_column", "messages_column", "id_column"):
        if column := getattr(cfg, key):
            sources.append((column, f"input.{key}"))
    return sources + [(c, "output.keep_columns") for c in keep_columns]


def _parquet_records(
    fs: AbstractFileSystem, path: str, spec: ShardSpec, cfg: InputConfig, keep_columns: Sequence[str]
) -> list[dict[str, Any]]:
    """Rows [start, stop) as dicts, reading only the row groups that hold them."""
    with fs.open(path, "rb") as f:
        pf = pq.ParquetFile(f)
        check_columns({f.name: f.type for f in pf.schema_arrow}, spec.url, cfg, keep_columns)
        groups, first_row, group_start = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            group_stop = group_start + pf.metadata.row_group(g).num_rows
            if group_start < spec.stop and group_stop > spec.start:
                groups.append(g)
                first_row = group_start if first_row is None else first_row
            group_start = group_stop
        if not groups:
            return []
        columns = list(dict.fromkeys(c for c, _ in _column_sources(cfg, keep_columns)))
        table = pf.read_row_groups(groups, columns=columns)
    return table.slice(spec.start - first_row, spec.stop - spec.start).to_pylist()


def jsonl_lines(fs: AbstractFileSystem, path: str, spec: ShardSpec) -> list[tuple[int, bytes]]:
    """(byte offset, line) for every line that starts in [start, stop)."""
    lines = []
    with fs.open(path, "rb") as f:
        if spec.start > 0:
            f.seek(spec.start - 1)
            f.readline()  # the line holding byte start-1 belongs to the previous shard
        offset = f.tell()
        while offset < spec.stop:
            line = f.readline()
            if not line:
                break
            lines.append((offset, line))
            offset += len(line)
    return lines


def _jsonl_row(line: bytes, where: str, derived_id: str, cfg: InputConfig, keep_columns: Sequence[str]) -> InputRow:
    try:
        record = json.loads(line)
    except ValueError as exc:
        return InputRow(derived_id, None, None, error=f"{where}: not valid JSON ({exc})")
    if not isinstance(record, dict):
        return InputRow(derived_id, None, None, error=f"{where}: not a JSON object")
    return _to_row(record, where, derived_id, cfg, keep_columns)


def _to_row(
    record: dict[str, Any], where: str, derived_id: str, cfg: InputConfig, keep_columns: Sequence[str]
) -> InputRow:
    """An InputRow from one record; every problem with it ends up in the row's error."""
    problems = []
    row_id = derived_id
    if cfg.id_column:
        if record.get(cfg.id_column) is None:
            problems.append(f"id column '{cfg.id_column}' is null or missing")
        else:
            row_id = str(record[cfg.id_column])
    prompt, messages = None, None
    try:
        if cfg.template is not None:
            prompt = _render(cfg.template, record)
        elif cfg.messages_column:
            messages = _messages(record.get(cfg.messages_column), cfg.messages_column)
        else:
            prompt = _text(record.get(cfg.prompt_column), cfg.prompt_column)  # type: ignore[arg-type]
    except _BadRow as exc:
        problems.append(str(exc))
    keep = {c: record.get(c) for c in keep_columns}
    return InputRow(row_id, prompt, messages, keep, f"{where}: {'; '.join(problems)}" if problems else None)


def _text(value: Any, column: str) -> str:
    if value is None:
        raise _BadRow(f"prompt column '{column}' is null or missing")
    if not isinstance(value, str):
        raise _BadRow(f"prompt column '{column}' holds {type(value).__name__}, not text")
    if not value.strip():
        raise _BadRow(f"prompt column '{column}' is empty")
    return value


def _messages(value: Any, column: str) -> list[dict[str, str]]:
    expected = f"messages column '{column}' must be a non-empty list of {{role: str, content: str}}"
    if not isinstance(value, list) or not value:
        got = "null" if value is None else "an empty list" if value == [] else type(value).__name__
        raise _BadRow(f"{expected}; got {got}")
    messages = []
    for n, message in enumerate(value):
        if not isinstance(message, dict):
            raise _BadRow(f"{expected}; message {n} is {type(message).__name__}")
        role, content = message.get("role"), message.get("content")
        if not isinstance(role, str) or not role or not isinstance(content, str):
            raise _BadRow(f"{expected}; message {n} has role {type(role).__name__}, content {type(content).__name__}")
        messages.append({"role": role, "content": content})
    return messages


def _render(template: str, record: dict[str, Any]) -> str:
    fields = template_fields(template)
    missing = [f for f in fields if f not in record]
    if missing:
        raise _BadRow(f"template names missing column(s) {', '.join(missing)}")
    nulls = [f for f in fields if record[f] is None]
    if nulls:
        raise _BadRow(f"template column(s) {', '.join(nulls)} are null")
    try:
        prompt = template.format_map(record)
    except (LookupError, AttributeError, ValueError, TypeError) as exc:
        raise _BadRow(f"template cannot be filled: {type(exc).__name__}: {exc}") from None
    if not prompt.strip():
        raise _BadRow("template gives an empty prompt")
    return prompt


def write_shard_output(
    output_url: str, shard_id: str, table: pa.Table, storage_options: dict[str, Any] | None = None
) -> str:
    """Write OUTPUT/data/{shard_id}.parquet atomically and return its URL.

    The table is serialized in memory and written in one piece, so a retried or duplicated shard
    replaces the same key and a reader never sees a partial file.
    """
    sink = pa.BufferOutputStream()
    pq.write_table(table, sink)
    url = join(output_url, "data", f"{shard_id}.parquet")
    write_bytes_atomic(url, sink.getvalue().to_pybytes(), storage_options)
    return url
