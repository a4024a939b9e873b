"""Whether a job's slow shards are the job's doing or the machine's.

Every shard of a job runs the same models on the same kind of device, so its milliseconds per target pass
agree within a small factor (batch fill and pass width move it, less than 2x on the machines measured). When
they differ by more than SPREAD_LIMIT, something outside the job took the processor: other processes (the
load average says so) or a hypervisor (CPU steal). The summary, `specbatch show` and the report say so, so
that nobody tunes a job against a busy machine. `spread` and `verdict` take any named timings, so the
benchmark can judge its cells the same way.
"""
from __future__ import annotations

import os
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from workers.schemas import ShardStats

SPREAD_LIMIT = 3.0
MIN_PASSES = 8  # a shard with fewer target passes has a time per pass made of warm-up, not of the machine
PROC_STAT = "/proc/stat"


@dataclass(frozen=True)
class CpuTimes:
    """The machine's CPU time so far (Linux /proc/stat, in clock ticks): stolen by a hypervisor, and in all."""

    steal: int
    total: int


def cpu_times(path: str = PROC_STAT) -> CpuTimes | None:
    """Now's counters, or None where /proc/stat is missing or has no steal column (not Linux, old kernels)."""
    try:
        with open(path) as f:
            first = f.readline().split()
    except OSError:
        return None
    if len(first) < 9 or first[0] != "cpu":
        return None
    ticks = [int(v) for v in first[1:9]]  # user nice system idle iowait irq softirq steal (guest is inside user)
    return CpuTimes(steal=ticks[7], total=sum(ticks))


@dataclass(frozen=True)
class MachineLoad:
    """What else the machine was doing: its load average now and the share of CPU time stolen since a start."""

    load_average: tuple[float, float, float] | None
    cpu_steal: float | None
    cpus: int | None

    @classmethod
    def since(cls, start: CpuTimes | None, path: str = PROC_STAT) -> MachineLoad:
        """The load now and the steal since `start` (None when either reading is missing or no time passed)."""
        try:
            load = tuple(round(x, 2) for x in os.getloadavg())
        except OSError:
            load = None
        end = cpu_times(path)
        ticks = end.total - start.total if start and end else 0
        steal = round((end.steal - start.steal) / ticks, 4) if ticks > 0 else None
        return cls(load, steal, os.cpu_count())  # type: ignore[arg-type]


@dataclass(frozen=True)
class Spread:
    """The fastest and slowest of some named timings and their ratio."""

    fastest: str
    fastest_ms: float
    slowest: str
    slowest_ms: float

    @property
    def ratio(self) -> float:
        return self.slowest_ms / self.fastest_ms

    @property
    def noisy(self) -> bool:
        return self.ratio > SPREAD_LIMIT


def ms_per_pass(stats: Iterable[ShardStats]) -> dict[str, float]:
    """Each shard's milliseconds per target pass (verify time over passes), for shards with MIN_PASSES or more,
    leaving out a worker's first shard where it ran others: its first passes pay the warm-up (allocations,
    caches), several times a steady pass for small models."""
    by_worker: dict[tuple[str, str], list[ShardStats]] = defaultdict(list)
    for s in sorted(stats, key=lambda s: s.started_at):
        if s.target_passes >= MIN_PASSES and s.verify_s > 0:
            by_worker[(s.run_id, s.worker_id)].append(s)
    warm = [s for shards in by_worker.values() for s in (shards[1:] or shards)]
    return {s.shard_id: 1000 * s.verify_s / s.target_passes for s in warm}


def spread(times: Mapping[str, float]) -> Spread | None:
    """The spread of named timings (None with fewer than two)."""
    if len(times) < 2:
        return None
    fastest, slowest = min(times, key=times.__getitem__), max(times, key=times.__getitem__)
    return Spread(fastest, times[fastest], slowest, times[slowest])


def load_text(load: MachineLoad) -> str:
    """"load average 11.8 10.2 6.1 on 2 CPUs; CPU steal 0.0 %", leaving out what could not be read."""
    parts = []
    if load.load_average:
        cpus = f" on {load.cpus} CPUs" if load.cpus else ""
        parts.append("load average " + " ".join(f"{x:.1f}" for x in load.load_average) + cpus)
    if load.cpu_steal is not None:
        parts.append(f"CPU steal {100 * load.cpu_steal:.1f} %")
    return "; ".join(parts) or "load average and CPU steal not readable here"


def verdict(found: Spread, load: MachineLoad | None, unit: str = "shard") -> str:
    """One sentence on a noisy spread: which two differ, by how much, and what the machine was doing."""
    machine = f" ({load_text(load)})" if load else ""
    return (f"{unit}s differ {found.ratio:.1f}x in ms per target pass ({found.slowest} {found.slowest_ms:.1f} ms, "
            f"{found.fastest} {found.fastest_ms:.1f} ms; more than {SPREAD_LIMIT:g}x): a loaded or throttled machine, "
            f"not the job{machine}")


def noise_summary(stats: Iterable[ShardStats], load: MachineLoad | None) -> dict:
    """summary.json's `noise`: the shards' spread in ms per target pass, the machine's load, and the verdict."""
    found = spread(ms_per_pass(stats))
    return {"spread": round(found.ratio, 2) if found else None, "limit": SPREAD_LIMIT,
            "fastest": {"shard_id": found.fastest, "ms_per_pass": round(found.fastest_ms, 3)} if found else None,
            "slowest": {"shard_id": found.slowest, "ms_per_pass": round(found.slowest_ms, 3)} if found else None,
            "noisy": bool(found and found.noisy),
            "load_average": list(load.load_average) if load and load.load_average else None,
            "cpu_steal": load.cpu_steal if load else None, "cpus": load.cpus if load else None,
            "message": verdict(found, load) if found and found.noisy else None}


def load_of(noise: Mapping | None) -> MachineLoad | None:
    """The machine's load as summary.json's `noise` recorded it (None when it holds none)."""
    if not noise or (noise.get("load_average") is None and noise.get("cpu_steal") is None):
        return None
    average = noise.get("load_average")
    return MachineLoad(tuple(average) if average else None, noise.get("cpu_steal"), noise.get("cpus"))
