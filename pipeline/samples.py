"""A few of a job's completions, read back from its output for people: `specbatch show` and the report.

Reads only the columns shown, from the first few data files in shard order, so it costs the same for a job
of ten rows or ten million. Where the output kept a `category` or `task` column (output.keep_columns), rows
are picked per value of it, so a mixed workload shows every kind of prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow.parquet as pq
from fsspec import AbstractFileSystem

from workers.storage import Store

COLUMNS = ["id", "sample_index", "prompt", "completion", "finish_reason", "completion_tokens", "error"]
GROUP_COLUMNS = ("category", "task")  # the first of these that the output has groups the samples
MAX_FILES = 8


@dataclass(frozen=True)
class Samples:
    """Rows (dicts of COLUMNS, plus the group column when there is one) and the column they are grouped by."""

    group_column: str | None
    rows: list[dict]


def read_samples(store: Store, per_group: int, groups: int = 1, max_files: int = MAX_FILES) -> Samples:
    """Up to `per_group` rows for each of the first `groups` values of the output's group column (with
    groups=1, or no such column: the first `per_group` rows), from at most `max_files` data files, reading
    each file a batch at a time and stopping as soon as every group is full."""
    files = [url.rsplit("/", 1)[-1] for url in store.list("data", suffixes=[".parquet"])][:max_files]
    if not files:
        return Samples(None, [])
    names = store.apply(lambda fs, path: pq.read_schema(path, filesystem=fs).names, "read", "data", files[0])
    group = next((c for c in GROUP_COLUMNS if c in names), None) if groups > 1 else None
    want = _Wanted(group, groups if group else 1, per_group)
    picked: dict[object, list[dict]] = {}
    for name in files:
        picked = store.apply(lambda fs, path, before=picked: want.pick(fs, path, before), "read", "data", name)
        if want.full(picked):
            break
    return Samples(group, [row for rows in picked.values() for row in rows])


@dataclass(frozen=True)
class _Wanted:
    """Which rows to keep: `per_group` rows for each of the first `groups` values of `group` (None: one group)."""

    group: str | None
    groups: int
    per_group: int

    def full(self, picked: dict[object, list[dict]]) -> bool:
        return len(picked) == self.groups and all(len(rows) == self.per_group for rows in picked.values())

    def pick(self, fs: AbstractFileSystem, path: str, picked: dict[object, list[dict]]) -> dict[object, list[dict]]:
        """`picked` with this file's rows added (a new dict: a retried read starts again from `picked`)."""
        found = {key: list(rows) for key, rows in picked.items()}
        columns = [*COLUMNS, self.group] if self.group else COLUMNS
        with fs.open(path, "rb") as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=256, columns=columns):
                for row in batch.to_pylist():
                    key = row[self.group] if self.group else None
                    if key in found or len(found) < self.groups:
                        bucket = found.setdefault(key, [])
                        if len(bucket) < self.per_group:
                            bucket.append(row)
                if self.full(found):
                    break
        return found


def clip(text: str | None, limit: int, one_line: bool = False) -> str:
    """Text cut to `limit` characters (… marks the cut); one_line folds line breaks into ⏎."""
    text = text or ""
    if one_line:
        text = " ⏎ ".join(line.strip() for line in text.strip().splitlines())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
