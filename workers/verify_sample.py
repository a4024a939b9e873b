"""`specbatch run --verify-sample N`: regenerate N of the job's rows with plain greedy decoding (k = 0)
and compare them token for token with what the job wrote.

Speculation is lossless by construction; this is the cheap proof of it on the user's own model, dtype
and device. The rows are picked by the driver (spread over the whole job, the same for the same job)
and checked by the workers, which already hold the models.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, replace

import pyarrow.parquet as pq

from workers.engine.controller import FixedK
from workers.engine.drafter import NoDrafter
from workers.engine.generator import Request, SpeculativeGenerator
from workers.schemas import ShardStats
from workers.storage import join, on_storage


@dataclass(frozen=True)
class RowCheck:
    """One regenerated row: `position` is the first token where the job's output and plain decoding
    differ (None: identical); the tokens there (-1: that side had already ended)."""
    shard_id: str
    id: str
    sample_index: int
    tokens: int
    position: int | None = None
    job_token: int = -1
    plain_token: int = -1


def pick_rows(stats: list[ShardStats], n: int, seed: int) -> dict[str, list[int]]:
    """Up to n output rows drawn uniformly from the whole job, by shard: {shard_id: row indexes}."""
    rows = [(s.shard_id, i) for s in sorted(stats, key=lambda s: s.shard_id) for i in range(s.rows)]
    picks: dict[str, list[int]] = {}
    for shard_id, i in sorted(random.Random(seed).sample(rows, min(n, len(rows)))):
        picks.setdefault(shard_id, []).append(i)
    return picks


def plain_generator(generator: SpeculativeGenerator) -> SpeculativeGenerator:
    """The same target, tokenizer and settings, without speculation."""
    return SpeculativeGenerator(generator.target, generator.tokenizer, NoDrafter(), FixedK(0),
                                replace(generator.settings, max_k=0))


def first_difference(job: list[int], plain: list[int]) -> tuple[int, int, int] | None:
    """(position, job token, plain token) of the first difference, -1 for the side that ended; None if equal."""
    for position in range(max(len(job), len(plain))):
        a = job[position] if position < len(job) else -1
        b = plain[position] if position < len(plain) else -1
        if a != b:
            return position, a, b
    return None


def check_rows(generator: SpeculativeGenerator, shard_id: str, output_url: str, storage_options: dict | None,
               requests: list[Request | None], picks: list[int]) -> list[RowCheck]:
    """Regenerate the picked rows of a committed shard (`requests[i]` is output row i's request, None for a
    row that failed) and compare each with the job's tokens."""
    columns = ["id", "sample_index", "completion_token_ids", "finish_reason"]
    table = on_storage(join(output_url, "data", f"{shard_id}.parquet"), storage_options,
                       lambda fs, path: pq.read_table(path, filesystem=fs, columns=columns), "read")
    written = table.to_pylist()
    runnable = [i for i in picks if requests[i] is not None and written[i]["finish_reason"] != "error"]
    result = plain_generator(generator).generate([requests[i] for i in runnable])
    checks = []
    for i, done in zip(runnable, result.completions):
        row = written[i]
        diff = first_difference(row["completion_token_ids"], done.token_ids)
        checks.append(RowCheck(shard_id, row["id"], row["sample_index"], len(done.token_ids), *(diff or (None,))))
    return checks


def summarize_checks(checks: list[RowCheck]) -> dict:
    """The summary's `verify_sample` entry."""
    differing = [c for c in checks if c.position is not None]
    return {"rows": len(checks), "identical": len(checks) - len(differing),
            "tokens": sum(c.tokens for c in checks),
            "mismatches": [{"shard_id": c.shard_id, "id": c.id, "sample_index": c.sample_index,
                            "position": c.position, "job_token": c.job_token, "plain_token": c.plain_token}
                           for c in differing]}
