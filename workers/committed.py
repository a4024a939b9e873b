"""A job's output read back as (prompt ids, completion ids), prompts encoded as the job's workers encoded
them: the learning job's training data (workers/learning.py), `specbatch distill --from`, and the suffix
drafters of the other workers all read completions this way."""
from __future__ import annotations

import hashlib
import io
import json

import pyarrow.parquet as pq

from workers.config import JobConfig
from workers.registry import encode_prompt
from workers.shard_io import InputRow
from workers.storage import read_bytes

Sequence = tuple[list[int], list[int]]  # (prompt ids, completion ids)
HELDOUT_FRACTION = 0.1


def is_heldout(row_id: str, fraction: float) -> bool:
    """A stable split by row id: the same prompts are held out on every run and machine."""
    digest = hashlib.blake2b(row_id.encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") / 2**64 < fraction


def committed_sequences(urls: list[str], config: JobConfig, tokenizer) -> list[tuple[str, Sequence]]:
    """(row id, sequence) for every completed row of the given output data files."""
    options, chat = config.output.storage_options, config.input.messages_column is not None
    found = []
    for url in urls:
        table = pq.read_table(io.BytesIO(read_bytes(url, options)),
                              columns=["id", "prompt", "completion_token_ids", "finish_reason"])
        for record in table.to_pylist():
            if record["finish_reason"] == "error" or not record["completion_token_ids"]:
                continue
            row = InputRow(record["id"], None if chat else record["prompt"], json.loads(record["prompt"]) if chat else None)
            prompt = encode_prompt(tokenizer, row.prompt, row.messages, config.generation.chat_template)
            found.append((record["id"], (prompt, list(record["completion_token_ids"]))))
    return found
