"""Shard planning from metadata only: the driver never reads prompts.

Parquet: the footer gives the row count and the schema, so missing or mistyped columns stop the
job before anything starts. JSONL: the first line is checked, and the file is cut into byte ranges
sized from the first 64 KiB to hold about rows_per_shard lines each (workers read the lines that
start in their range). Shard ids follow file order, so the same input and config always give the
same shards; resume depends on that.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import IO, Literal, NamedTuple

import pyarrow as pa
import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from workers.config import JobConfig
from workers.model_paths import check_head_path, check_model_path
from workers.shard_io import InputError, ShardSpec, jsonl_lines, check_columns
from workers.storage import is_transient, list_files, on_storage, safe_url

log = logging.getLogger(__name__)

KIND_BY_SUFFIX: dict[str, Literal["parquet", "jsonl"]] = {".parquet": "parquet", ".jsonl": "jsonl", ".json": "jsonl"}
SAMPLE_BYTES = 64 * 1024
_PLAN_THREADS = 8  # footers are small reads: overlap their latency on object stores


class SkippedFile(NamedTuple):
    url: str
    reason: str


@dataclass
class Plan:
    """The shards to run, the bad files skipped (on_bad_file=skip), and the row count when known.

    total_rows is None when any input is JSONL, whose line count is only estimated here.
    """

    shards: list[ShardSpec]
    skipped_files: list[SkippedFile]
    total_rows: int | None


class _FileRanges(NamedTuple):
    ranges: list[tuple[int, int]]
    rows: int | None


class _CorruptFile(Exception):
    """The file is not what its name says (not Parquet, not JSONL)."""


def kind_of(url: str) -> Literal["parquet", "jsonl"] | None:
    """The input format a file name announces, or None when it is not an input file."""
    for suffix, kind in KIND_BY_SUFFIX.items():
        if url.lower().endswith(suffix):
            return kind
    return None


def plan_job(config: JobConfig) -> Plan:
    """Everything checked before Ray and torch start: the models (or MTP head) exist, the input lists and has
    its columns."""
    model = config.model
    for path in filter(None, (model.target, model.draft if "model" in model.drafters else None)):
        check_model_path(path, config.input.storage_options)
    if "mtp" in model.drafters:
        check_head_path(model.draft, config.input.storage_options)
    return plan_shards(config)


def plan_shards(config: JobConfig) -> Plan:
    """List the input files and cut them into shards, reading metadata only."""
    cfg = config.input
    urls = list_files(cfg.path, cfg.storage_options, KIND_BY_SUFFIX)
    if not urls:
        raise InputError(f"{safe_url(cfg.path)}: no input files there (looked for {', '.join(KIND_BY_SUFFIX)})")
    with ThreadPoolExecutor(min(_PLAN_THREADS, len(urls))) as pool:
        inspected = list(pool.map(lambda url: _inspect(url, config), urls))
    shards: list[ShardSpec] = []
    skipped: list[SkippedFile] = []
    total: int | None = 0
    for url, found in zip(urls, inspected):
        if isinstance(found, SkippedFile):
            skipped.append(found)
            continue
        kind = kind_of(url)
        for start, stop in found.ranges:
            shards.append(ShardSpec(f"shard-{len(shards):05d}", url, kind, start, stop))  # type: ignore[arg-type]
        total = None if total is None or found.rows is None else total + found.rows
    if cfg.limit is not None:
        shards, total = first_rows(shards, cfg.limit, cfg.storage_options)
    return Plan(shards, skipped, total)


def first_rows(shards: list[ShardSpec], limit: int, storage_options: dict) -> tuple[list[ShardSpec], int]:
    """The shards holding the input's first `limit` rows, the last one cut short, and their row count. Shard ids
    stay those of the whole job's plan, so the whole job later resumes the slice. JSONL lines are counted by
    reading the shards the limit reaches (at most about `limit` lines); Parquet needs no read."""
    kept, left = [], limit
    for spec in shards:
        if left == 0:
            break
        if spec.kind == "parquet":
            rows, cut = spec.stop - spec.start, spec.start + left
        else:
            lines = on_storage(spec.url, storage_options, lambda fs, path: jsonl_lines(fs, path, spec), "read")
            starts = [offset for offset, line in lines if line.strip()]
            rows, cut = len(starts), starts[left] if len(starts) > left else spec.stop
        kept.append(replace(spec, stop=cut) if rows > left else spec)
        left -= min(rows, left)
    return kept, limit - left


def _inspect(url: str, config: JobConfig) -> _FileRanges | SkippedFile:
    """One file's ranges, or SkippedFile when it is corrupt and on_bad_file is skip."""
    plan_file = _parquet_ranges if kind_of(url) == "parquet" else _jsonl_ranges
    try:
        return on_storage(url, config.input.storage_options, lambda fs, path: plan_file(fs, path, url, config), "read")
    except _CorruptFile as exc:
        if config.input.on_bad_file == "fail":
            raise InputError(f"{safe_url(url)}: {exc} (set input.on_bad_file: skip to skip such files)") from None
        log.warning("skipping %s: %s", safe_url(url), exc)
        return SkippedFile(url, str(exc))


def _parquet_ranges(fs: AbstractFileSystem, path: str, url: str, config: JobConfig) -> _FileRanges:
    with fs.open(path, "rb") as f:
        try:
            pf = pq.ParquetFile(f)
        except (pa.ArrowException, OSError) as exc:
            if is_transient(exc) or isinstance(exc, (FileNotFoundError, PermissionError)):
                raise
            raise _CorruptFile(f"not a readable Parquet file ({exc})") from None
        columns = {f.name: f.type for f in pf.schema_arrow}
        rows = pf.metadata.num_rows
    check_columns(columns, url, config.input, config.output.keep_columns)
    step = config.sharding.rows_per_shard
    return _FileRanges([(s, min(s + step, rows)) for s in range(0, rows, step)], rows)


def _jsonl_ranges(fs: AbstractFileSystem, path: str, url: str, config: JobConfig) -> _FileRanges:
    size = fs.size(path)
    with fs.open(path, "rb") as f:
        first = _first_record(f)
        f.seek(0)
        sample = f.read(SAMPLE_BYTES)
    if first is None:
        return _FileRanges([], 0)
    check_columns(dict.fromkeys(first), url, config.input, config.output.keep_columns)
    lines = sample.count(b"\n") + (len(sample) == size and not sample.endswith(b"\n"))
    step = max(1, round(len(sample) / max(lines, 1) * config.sharding.rows_per_shard))
    return _FileRanges([(s, min(s + step, size)) for s in range(0, size, step)], None)


def _first_record(f: IO[bytes]) -> dict | None:
    """The first non-blank line as a JSON object, or None for a blank file."""
    for line in iter(f.readline, b""):
        if line.strip():
            try:
                record = json.loads(line)
            except ValueError:
                raise _CorruptFile("its first line is not JSON; not a JSONL file?") from None
            if not isinstance(record, dict):
                raise _CorruptFile("its first line is not a JSON object; not a JSONL file?")
            return record
    return None
