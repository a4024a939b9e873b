"""A few of a job's completions, read back from its output for people: `specbatch show` and the report.

Reads only the columns shown, from the first few data files in shard order, so it costs the same for a job
of ten rows or ten million. Where the output kept a `category` or `task` column (output.keep_columns), rows
are picked per value of it, so a mixed workload shows every kind of prompt.
"""
from __future__ import annotations

from dataclasses import dataclass

import pyarrow.parquet as pq

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
    groups=1, or no such column: the first `per_group` rows), from at most `max_files` data files."""
    files = [url.rsplit("/", 1)[-1] for url in store.list("data", suffixes=[".parquet"])][:max_files]
    if not files:
        return Samples(None, [])
    names = store.apply(lambda fs, path: pq.read_schema(path, filesystem=fs).names, "read", "data", files[0])
    group = next((c for c in GROUP_COLUMNS if c in names), None) if groups > 1 else None
    wanted, columns = (groups, [*COLUMNS, group]) if group else (1, COLUMNS)
    picked: dict[object, list[dict]] = {}
    for name in files:
        table = store.apply(lambda fs, path: pq.read_table(path, filesystem=fs, columns=columns), "read", "data", name)
        for row in table.to_pylist():
            key = row[group] if group else None
            if key in picked or len(picked) < wanted:
                bucket = picked.setdefault(key, [])
                if len(bucket) < per_group:
                    bucket.append(row)
        if len(picked) == wanted and all(len(rows) == per_group for rows in picked.values()):
            break
    return Samples(group, [row for rows in picked.values() for row in rows])


def clip(text: str | None, limit: int, one_line: bool = False) -> str:
    """Text cut to `limit` characters (… marks the cut); one_line folds line breaks into ⏎."""
    text = text or ""
    if one_line:
        text = " ⏎ ".join(line.strip() for line in text.strip().splitlines())
    return text if len(text) <= limit else text[: limit - 1].rstrip() + "…"
