"""The Arrow schemas of a job's output: the contract between workers, driver and users.

Workers write rows in OUTPUT_SCHEMA and return one STATS_SCHEMA row per shard; the driver and
users read them back. Changing a name here changes the product's output format.
"""

from __future__ import annotations

from collections.abc import Sequence

import pyarrow as pa

FINISH_REASONS = ("stop", "length", "error")

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt", pa.string()),  # null when the row's prompt itself was bad
        pa.field("completion", pa.string()),
        pa.field("completion_token_ids", pa.list_(pa.int32())),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string(), nullable=False),  # one of FINISH_REASONS
        pa.field("error", pa.string()),  # null when the row is fine
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("prompt_tokens", pa.int32()),
        # this row's speculation: verify passes it took part in, drafts verified and accepted, the drafter
        pa.field("target_passes", pa.int32()),
        pa.field("drafted_tokens", pa.int32()),
        pa.field("accepted_tokens", pa.int32()),
        pa.field("drafter", pa.string()),
    ]
)

STATS_SCHEMA = pa.schema(
    [
        pa.field("shard_id", pa.string()),
        pa.field("worker_id", pa.string()),
        pa.field("node", pa.string()),
        pa.field("device", pa.string()),
        pa.field("rows", pa.int64()),
        pa.field("prompt_tokens", pa.int64()),
        pa.field("generated_tokens", pa.int64()),
        pa.field("wall_s", pa.float64()),
        pa.field("tokens_per_s", pa.float64()),
        pa.field("target_passes", pa.int64()),
        pa.field("draft_passes", pa.int64()),
        pa.field("drafted_tokens", pa.int64()),
        pa.field("accepted_tokens", pa.int64()),
        pa.field("acceptance_rate", pa.float64()),  # accepted / drafted
        pa.field("mean_accepted_per_pass", pa.float64()),  # generated tokens per target pass
        pa.field("accept_by_position", pa.list_(pa.float64())),
        pa.field("k_hist", pa.list_(pa.int64())),  # counts for k = 0..max_k
        pa.field("draft_s", pa.float64()),
        pa.field("verify_s", pa.float64()),
        pa.field("peak_mem_bytes", pa.int64()),
        pa.field("attempt", pa.int32()),
        pa.field("failed_rows", pa.int64()),
    ]
)


def output_schema(keep_fields: Sequence[pa.Field] = ()) -> pa.Schema:
    """OUTPUT_SCHEMA with the job's keep_columns appended after the fixed columns."""
    return pa.schema(list(OUTPUT_SCHEMA) + list(keep_fields))
