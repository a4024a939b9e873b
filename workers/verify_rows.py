"""The workers' half of `--verify-sample`: regenerate picked rows of a committed shard without speculation."""
from __future__ import annotations

from dataclasses import replace

import pyarrow.parquet as pq

from workers.engine.controller import FixedK
from workers.engine.drafter import NoDrafter
from workers.engine.generator import Request, SpeculativeGenerator
from workers.storage import join, on_storage
from workers.verify_sample import RowCheck, first_difference


def plain_generator(generator: SpeculativeGenerator) -> SpeculativeGenerator:
    """The same target, tokenizer and settings, without speculation."""
    return SpeculativeGenerator(generator.target, generator.tokenizer, NoDrafter(), FixedK(0),
                                replace(generator.settings, max_k=0))


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
