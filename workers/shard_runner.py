"""Run one shard: read its rows, tokenize, generate, write its Parquet, return its statistics.

Plain Python (no Ray) so that the benchmark and the tests can drive exactly what a worker actor runs.
"""
from __future__ import annotations

import hashlib
import json
import platform
import resource
import time

import pyarrow as pa
import torch

from workers.committed import committed_sequences
from workers.config import JobConfig
from workers.engine.generator import Completion, Request
from workers.engine.suffix_drafter import SuffixDrafter
from workers.registry import (
    Models,
    drafter_parts,
    encode_prompt,
    load_models,
    make_generator,
    pick_device,
    with_learned_head,
)
from workers.schemas import ShardStats, output_schema
from workers.shard_io import InputRow, ShardSpec, declared_types, read_shard, write_shard_output
from workers.storage import join, write_bytes_atomic
from workers.verify_rows import check_rows
from workers.verify_sample import RowCheck


def row_seed(job_seed: int, row_id: str, sample_index: int) -> int:
    """A 63-bit seed from the job seed, row id and sample index: stable across processes and machines."""
    digest = hashlib.blake2b(f"{job_seed}\x00{row_id}\x00{sample_index}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class ShardRunner:
    """Holds the models once; turns shard specs into committed output files and stats rows."""

    def __init__(self, config: JobConfig, worker_id: str = "local", models: Models | None = None,
                 ray_node_id: str | None = None):
        self.config, self.worker_id, self.ray_node_id = config, worker_id, ray_node_id
        self.device = pick_device()
        self.models = models or load_models(config, self.device)
        self.generator = make_generator(config, self.models)
        if config.generation.chat_template and not getattr(self.models.tokenizer, "chat_template", None):
            raise ValueError(f"model {config.model.target} has no chat template; set generation.chat_template: false")

    def use_head(self, files: dict[str, bytes]) -> None:
        """Switch to the job's learnt MTP head (between shards: no batch is in flight)."""
        self.generator = with_learned_head(self.config, self.models, self.generator.drafter, files)

    def read_completions(self, urls: list[str]) -> None:
        """Index other workers' committed shards in this worker's suffix drafter, so that its drafts come from
        the whole job's output and not only from the shards it ran itself."""
        suffix = [d for d in drafter_parts(self.generator.drafter) if isinstance(d, SuffixDrafter)]
        if suffix and urls:
            for _, (prompt, completion) in committed_sequences(urls, self.config, self.models.tokenizer):
                suffix[0].index.add(prompt + completion)

    def _encode(self, row: InputRow) -> list[int]:
        return encode_prompt(self.models.tokenizer, row.prompt, row.messages, self.config.generation.chat_template)

    def requests(self, rows: list[InputRow]) -> tuple[list[Request], list[tuple[InputRow, int, int, str | None]]]:
        """One request per (row, sample); rows that cannot run keep their error and no request."""
        requests, slots, seen = [], [], {}
        for row in rows:
            error = row.error
            if error is None and row.id in seen:
                if self.config.input.duplicate_ids == "suffix":
                    seen[row.id] += 1
                    row.id = f"{row.id}#{seen[row.id]}"
                else:
                    error = f"duplicate id {row.id!r} in the input (set input.duplicate_ids: suffix to keep both)"
            seen.setdefault(row.id, 0)
            ids: list[int] = []
            if error is None:
                try:
                    ids = self._encode(row)
                except Exception as exc:  # a malformed chat for this tokenizer's template
                    error = f"cannot tokenize row {row.id!r}: {type(exc).__name__}: {exc}"
            for sample in range(self.config.generation.samples_per_prompt):
                seed = row_seed(self.config.generation.seed, row.id, sample)
                slots.append((row, sample, seed, error))
                if error is None:
                    requests.append(Request(f"{row.id}/{sample}", ids, seed))
        return requests, slots

    def run(self, spec: ShardSpec, attempt: int = 1, run_id: str = "") -> ShardStats:
        """Generate a shard, commit its output atomically, write its stats part, and return its stats."""
        started_at, started = time.time(), time.perf_counter()
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        rows = read_shard(spec, self.config.input, self.config.output.keep_columns)
        requests, slots = self.requests(rows)
        result = self.generator.generate(requests)
        keep_types = declared_types(spec, self.config.input) if self.config.output.keep_columns else {}
        table = self._table(slots, iter(result.completions), keep_types)
        out = self.config.output
        write_shard_output(out.path, spec.shard_id, table, out.storage_options)
        stats = ShardStats.from_generation(
            result.stats, table.column("finish_reason").to_pylist(),
            shard_id=spec.shard_id, worker_id=self.worker_id, node=platform.node(), ray_node_id=self.ray_node_id,
            device=str(self.device),
            run_id=run_id, attempt=attempt, input_start=spec.start, input_stop=spec.stop,
            drafter=self.generator.drafter.name, started_at=started_at, finished_at=time.time(),
            wall_s=time.perf_counter() - started, peak_mem_bytes=_peak_memory(self.device))
        write_bytes_atomic(join(out.path, "stats", "parts", f"{spec.shard_id}.json"),
                           json.dumps(stats.to_dict()).encode(), out.storage_options)
        return stats

    def verify(self, spec: ShardSpec, picks: list[int]) -> list[RowCheck]:
        """Regenerate the picked output rows of a committed shard without speculation and compare them
        with what the shard wrote (`specbatch run --verify-sample`)."""
        requests, slots = self.requests(read_shard(spec, self.config.input, self.config.output.keep_columns))
        queue = iter(requests)
        by_row = [None if error else next(queue) for *_, error in slots]
        out = self.config.output
        return check_rows(self.generator, spec.shard_id, out.path, out.storage_options, by_row, picks)

    def _table(self, slots, completions, keep_types: dict[str, pa.DataType]) -> pa.Table:
        records = []
        for row, sample, seed, error in slots:
            done: Completion = Completion([], "", "error", error) if error else next(completions)
            prompt = row.prompt if row.messages is None else json.dumps(row.messages, ensure_ascii=False)
            records.append({"id": row.id, "sample_index": sample, "prompt": prompt,
                            "completion": None if done.error else done.text,
                            "completion_token_ids": done.token_ids, "completion_tokens": len(done.token_ids),
                            "finish_reason": done.finish_reason, "error": done.error, "seed": seed,
                            "prompt_tokens": done.prompt_tokens, "target_passes": done.target_passes,
                            "drafted_tokens": done.drafted_tokens, "accepted_tokens": done.accepted_tokens,
                            "drafter": None if done.error else self.generator.drafter.name,
                            "logprobs": done.logprobs,
                            "top_logprobs": None if done.top_logprobs is None else
                            [[{"token_id": t, "logprob": lp} for t, lp in position] for position in done.top_logprobs],
                            **row.keep})
        keep = self.config.output.keep_columns
        keep_fields = [pa.field(c, keep_types.get(c) or (pa.array([r[c] for r in records]).type if records else pa.null()))
                       for c in keep]
        return pa.Table.from_pylist(records, schema=output_schema(keep_fields))


def _peak_memory(device: torch.device) -> int:
    if device.type == "cuda":
        return int(torch.cuda.max_memory_allocated())
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
