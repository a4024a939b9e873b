"""The contract between workers, driver and users: the output rows' Arrow schema and the shard record.

Workers write rows in OUTPUT_SCHEMA and return one ShardStats per shard (also written as
stats/parts/SHARD.json); the driver gathers them into stats/shards.parquet in STATS_SCHEMA, which
ShardStats defines. Changing a name here changes the product's output format.
"""

from __future__ import annotations

import collections
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field, fields
from typing import TYPE_CHECKING, Any, ClassVar, get_type_hints

import pyarrow as pa

if TYPE_CHECKING:
    from workers.engine.stats import GenerationStats
    from workers.shard_io import ShardSpec

OUTPUT_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("sample_index", pa.int32(), nullable=False),
        pa.field("prompt", pa.string()),  # null when the row's prompt itself was bad
        pa.field("completion", pa.string()),
        pa.field("completion_token_ids", pa.list_(pa.int32())),
        pa.field("completion_tokens", pa.int32()),
        pa.field("finish_reason", pa.string(), nullable=False),  # stop | length | error
        pa.field("error", pa.string()),  # null when the row is fine
        pa.field("seed", pa.int64(), nullable=False),
        pa.field("prompt_tokens", pa.int32()),
        # this row's speculation: verify passes it took part in, drafts verified and accepted, the drafter
        pa.field("target_passes", pa.int32()),
        pa.field("drafted_tokens", pa.int32()),
        pa.field("accepted_tokens", pa.int32()),
        pa.field("drafter", pa.string()),
        # generation.logprobs: the chosen token's log-probability per position, and the most likely tokens'
        pa.field("logprobs", pa.list_(pa.float32())),
        pa.field("top_logprobs", pa.list_(pa.list_(pa.struct([("token_id", pa.int32()), ("logprob", pa.float32())])))),
    ]
)


def output_schema(keep_fields: Sequence[pa.Field] = ()) -> pa.Schema:
    """OUTPUT_SCHEMA with the job's keep_columns appended after the fixed columns."""
    return pa.schema(list(OUTPUT_SCHEMA) + list(keep_fields))


def _ratio(num: float, den: float) -> float:
    return num / den if den else 0.0


def _add(a: list[int], b: list[int]) -> list[int]:
    """Element-wise sum of two count lists of possibly different lengths (jobs may mix max_k)."""
    longer, shorter = (a, b) if len(a) >= len(b) else (b, a)
    return [x + (shorter[i] if i < len(shorter) else 0) for i, x in enumerate(longer)]


@dataclass(kw_only=True)
class Counters:
    """What generating some rows took. Every field adds up across shards; ratios are properties of the
    sums, so a worker's or a whole job's figures use the same formulas as a shard's."""

    rows: int = 0  # output rows: input rows x samples_per_prompt
    stop_rows: int = 0  # finish_reason stop (EOS or a stop string)
    length_rows: int = 0  # finish_reason length (max_new_tokens)
    failed_rows: int = 0  # finish_reason error
    prompt_tokens: int = 0
    prefilled_tokens: int = 0  # prompt tokens computed; the rest were copied from a cached row's shared prefix
    generated_tokens: int = 0
    target_passes: int = 0  # verify (or plain decode) forward passes of the target over the batch
    row_passes: int = 0  # rows summed over target passes
    draft_passes: int = 0
    drafted_tokens: int = 0
    accepted_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float = 0.0
    draft_s: float = 0.0
    verify_s: float = 0.0
    controller_s: float = 0.0  # in the controller: choosing offers and the draft stop, observing each step
    other_s: float = 0.0  # the rest of the generator's wall time (accepting, retiring, stop checks, planning)
    attempted_by_position: list[int] = field(default_factory=list)  # rows that reached draft position i
    accepted_by_position: list[int] = field(default_factory=list)  # ... and had it accepted
    k_hist: list[int] = field(default_factory=list)  # target passes at k = 0..max_k

    # Ratios written next to the counters in stats/shards.parquet and summary.json.
    DERIVED: ClassVar[dict[str, pa.DataType]] = {
        "tokens_per_s": pa.float64(),
        "acceptance_rate": pa.float64(),
        "tokens_per_row_pass": pa.float64(),
        "batch_tokens_per_pass": pa.float64(),
        "accept_by_position": pa.list_(pa.float64()),
    }

    @property
    def tokens_per_s(self) -> float:
        """Generated tokens per second of wall time (summed over shards: per worker-second)."""
        return _ratio(self.generated_tokens, self.wall_s)

    @property
    def acceptance_rate(self) -> float:
        """Accepted / drafted tokens."""
        return _ratio(self.accepted_tokens, self.drafted_tokens)

    @property
    def tokens_per_row_pass(self) -> float:
        """Tokens a row gains per target pass: the accepted draft length + 1 (1.0 without speculation)."""
        return _ratio(self.generated_tokens, self.row_passes)

    @property
    def batch_tokens_per_pass(self) -> float:
        """Tokens the whole batch gains per target pass (rows x tokens per row pass)."""
        return _ratio(self.generated_tokens, self.target_passes)

    @property
    def accept_by_position(self) -> list[float | None]:
        """Acceptance at draft position i of the rows that reached it (None where none did)."""
        return [a / t if t else None for a, t in zip(self.accepted_by_position, self.attempted_by_position)]

    @classmethod
    def total(cls, items: Iterable[Counters]) -> Counters:
        """The sum of several records' counters."""
        total = Counters()
        for item in items:
            for f in fields(Counters):
                a, b = getattr(total, f.name), getattr(item, f.name)
                setattr(total, f.name, _add(a, b) if isinstance(a, list) else a + b)
        return total

    def counters(self) -> dict[str, Any]:
        """The counters and the ratios, as plain data."""
        return {**{f.name: getattr(self, f.name) for f in fields(Counters)},
                **{name: getattr(self, name) for name in self.DERIVED}}


@dataclass(kw_only=True)
class ShardStats(Counters):
    """One committed shard: who ran it, where, when, and its counters."""

    shard_id: str
    worker_id: str
    node: str
    ray_node_id: str | None = None  # the Ray node the worker ran on (None outside Ray: the benchmark, tests)
    device: str
    run_id: str  # the driver run that dispatched it; earlier runs' shards were resumed
    attempt: int
    input_start: int = -1  # the input range it covered (ShardSpec.start/stop; -1: written before they were kept)
    input_stop: int = -1
    drafter: str = ""  # what drafted its rows (a learning job switches drafters between shards)
    started_at: float  # epoch seconds on the worker's clock
    finished_at: float
    peak_mem_bytes: int

    @classmethod
    def from_generation(cls, generation: GenerationStats, finish_reasons: Iterable[str], **shard: Any) -> ShardStats:
        """A shard's record from the generator's counters for exactly this shard and its rows' finish reasons."""
        reasons = collections.Counter(finish_reasons)
        counts = {f.name: getattr(generation, f.name) for f in fields(Counters) if hasattr(generation, f.name)}
        counts = {k: [int(x) for x in v] if hasattr(v, "__len__") else v for k, v in counts.items()}
        return cls(**shard, **counts, rows=sum(reasons.values()), stop_rows=reasons["stop"],
                   length_rows=reasons["length"], failed_rows=reasons["error"])

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ShardStats:
        """Read back a record written by to_dict (a stats part file); fields added since it was written take
        their defaults, so a job started by an older version resumes."""
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def covers(self, spec: ShardSpec) -> bool:
        """Whether this committed shard holds exactly the planned shard's rows (a `--limit` slice cuts its last
        shard short; the full job runs that shard again)."""
        return self.input_start < 0 or (self.input_start, self.input_stop) == (spec.start, spec.stop)

    def to_dict(self) -> dict[str, Any]:
        """The stored fields (a stats part file)."""
        return asdict(self)

    def to_row(self) -> dict[str, Any]:
        """A row of STATS_SCHEMA: the stored fields and the ratios."""
        return {**self.to_dict(), **{name: getattr(self, name) for name in self.DERIVED}}

    @classmethod
    def arrow_schema(cls) -> pa.Schema:
        arrow = {str: pa.string(), str | None: pa.string(), int: pa.int64(), float: pa.float64(),
                 list[int]: pa.list_(pa.int64())}
        hints = get_type_hints(cls)
        identity = [f for f in fields(cls) if f.name not in _COUNTER_NAMES]
        ordered = identity + [f for f in fields(cls) if f.name in _COUNTER_NAMES]
        return pa.schema([pa.field(f.name, arrow[hints[f.name]]) for f in ordered]
                         + [pa.field(name, t) for name, t in cls.DERIVED.items()])


_COUNTER_NAMES = {f.name for f in fields(Counters)}
STATS_SCHEMA = ShardStats.arrow_schema()
