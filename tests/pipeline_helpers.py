"""Configs and checks shared by the end-to-end tests (the fixtures they use live in conftest.py)."""
from __future__ import annotations

import collections

import pyarrow.parquet as pq

from workers.config import JobConfig
from workers.storage import filesystem, list_files, read_bytes


def make_config(model_dir: str, input_path: str, output_path: str, **sections) -> JobConfig:
    base = {
        "name": "t",
        "input": {"path": input_path},
        "output": {"path": output_path},
        "model": {"target": model_dir, "drafter": "ngram"},
        "generation": {"max_new_tokens": 12},
        "resources": {"workers": 1, "cpus_per_worker": 0.5, "batch_size": 4},
        "sharding": {"rows_per_shard": 4},
    }
    for section, values in sections.items():
        base[section] = {**base.get(section, {}), **values}
    return JobConfig.model_validate(base)


def read_output(config: JobConfig):
    urls = list_files(config.output.path.rstrip("/") + "/data", config.output.storage_options, [".parquet"])
    fs, _ = filesystem(config.output.path, config.output.storage_options)
    tables = [pq.read_table(filesystem(u, config.output.storage_options)[1], filesystem=fs) for u in urls]
    return [row for t in tables for row in t.to_pylist()]


def assert_exactly_once(config: JobConfig, ids: list[str], samples: int = 1) -> list[dict]:
    rows = read_output(config)
    counts = collections.Counter(r["id"] for r in rows)
    assert counts == {i: samples for i in ids}
    for i in ids:
        assert sorted(r["sample_index"] for r in rows if r["id"] == i) == list(range(samples))
    assert read_bytes(config.output.path.rstrip("/") + "/_SUCCESS", config.output.storage_options) == b""
    return rows


def prompts(n: int, prefix: str = "p") -> list[dict]:
    words = ["the quick brown fox", "rewrite this sentence", "def add(a, b)", "why is the sky blue"]
    return [{"id": f"{prefix}{i}", "prompt": f"{words[i % 4]} {i}", "task": words[i % 4][:3]} for i in range(n)]


