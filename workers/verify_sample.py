"""`specbatch run --verify-sample N`: regenerate N of the job's rows with plain greedy decoding (k = 0)
and compare them token for token with what the job wrote.

Speculation is lossless by construction; this is the cheap proof of it on the user's own model, dtype
and device. The rows are picked by the driver (spread over the whole job, the same for the same job)
and checked by the workers, which already hold the models (workers/verify_rows.py). This module is the
contract between the two and the driver's half: no torch here.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from workers.schemas import ShardStats


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


def first_difference(job: list[int], plain: list[int]) -> tuple[int, int, int] | None:
    """(position, job token, plain token) of the first difference, -1 for the side that ended; None if equal."""
    for position in range(max(len(job), len(plain))):
        a = job[position] if position < len(job) else -1
        b = plain[position] if position < len(plain) else -1
        if a != b:
            return position, a, b
    return None


def summarize_checks(checks: list[RowCheck]) -> dict:
    """The summary's `verify_sample` entry."""
    differing = [c for c in checks if c.position is not None]
    return {"rows": len(checks), "identical": len(checks) - len(differing),
            "tokens": sum(c.tokens for c in checks),
            "mismatches": [{"shard_id": c.shard_id, "id": c.id, "sample_index": c.sample_index,
                            "position": c.position, "job_token": c.job_token, "plain_token": c.plain_token}
                           for c in differing]}
