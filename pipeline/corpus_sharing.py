"""One suffix corpus for the whole job: each worker's suffix drafter also reads what the others committed.

A worker's suffix index sees the rows it generated itself. The driver keeps the committed shards in commit
order and, with each shard it hands a worker, names the shards other workers committed since that worker's
last one: the worker reads their completions from the output before it starts. A new or resumed worker
gets the newest committed shards up to `speculation.suffix_max_tokens` tokens (its index would evict older
ones anyway), so a resumed job's corpus starts warm.
"""
from __future__ import annotations

from workers.config import JobConfig
from workers.schemas import ShardStats
from workers.storage import join


class SharedCorpus:
    def __init__(self, config: JobConfig, committed: list[ShardStats]):
        self.enabled = "suffix" in config.model.drafters
        self.output, self.budget = config.output.path, config.speculation.suffix_max_tokens
        self.log: list[tuple[str, str, int]] = []  # (worker id, data url, tokens), in commit order
        self.read: dict[str, int] = {}             # worker id -> how much of the log it has been handed
        for stats in sorted(committed, key=lambda s: s.finished_at):
            self.commit(stats, writer="")          # an earlier run's shard: every worker reads it

    def commit(self, stats: ShardStats, writer: str | None = None) -> None:
        url = join(self.output, "data", f"{stats.shard_id}.parquet")
        self.log.append((stats.worker_id if writer is None else writer, url, stats.prompt_tokens + stats.generated_tokens))

    def unread(self, worker_id: str) -> tuple[str, ...]:
        """The data files committed by others since this worker's last shard, newest first within the budget."""
        if not self.enabled:
            return ()
        new, self.read[worker_id] = self.log[self.read.get(worker_id, 0):], len(self.log)
        urls, tokens = [], 0
        for writer, url, size in reversed(new):
            if writer == worker_id:
                continue
            if tokens + size > self.budget:
                break
            urls.append(url)
            tokens += size
        return tuple(reversed(urls))  # oldest first, as the worker's own rows were indexed
