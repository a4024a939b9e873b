"""The bench's peers (jobs/bench/peers.py) without the peers: `make bench-peers` is not run in CI, so the engines
are stood in for by tests/fake_peer.py, a real subprocess speaking the real protocol (peer_protocol.py) from a
fake virtualenv laid out where `make bench-peers` puts the real ones. Checked: a missing peer is skipped with
a message, the request and reply, runner lifetimes (vLLM: one per batch size), failures dropping a peer, the
ratio over the best peer and the tables, and a whole bench run with peers."""
from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pyarrow.parquet as pq
import pytest
from test_bench import tiny_bench_config, write_suite

from jobs.bench import benchmark
from jobs.bench.cells import add_ratios, summarize_cell
from jobs.bench.config import load_bench_config
from jobs.bench.peer_protocol import cut_at_eos
from jobs.bench.peers import PEERS, PeerError, PeerPool, add_peer_ratios, peers_root
from jobs.bench.report import markdown
from jobs.bench.roofline import Floor
from jobs.bench.systems import K0, PEER, SPECBATCH, TRANSFORMERS, Run, System
from jobs.bench.workloads import Prompt

FAKE = Path(__file__).parent / "fake_peer.py"
EOS = 2


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty cache folder: no peer installed."""
    monkeypatch.setenv("SPECBATCH_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def install_fake(peer: str, env: str = "", stamp: bool = True) -> None:
    """A fake virtualenv for `peer` where `make bench-peers` puts the real one: its python runs the fake runner."""
    venv = peers_root() / PEERS[peer].venv
    python = venv / "bin" / "python"
    python.parent.mkdir(parents=True, exist_ok=True)
    python.write_text(f'#!/bin/sh\n{env} exec "{sys.executable}" "{FAKE}" "$@"\n')
    python.chmod(python.stat().st_mode | stat.S_IEXEC)
    if stamp:
        (venv / ".complete-test").touch()


def pool_for(peers: list[str], logs: list[str] | None = None, device: str = "cpu") -> PeerPool:
    cfg = load_bench_config({"peers": peers, "prompt_lookup_num_tokens": 4})
    return PeerPool(cfg, device, lambda: Path("/models/tiny"), 2, 512, [EOS],
                    (logs if logs is not None else []).append)


def prompts(*firsts: int) -> list[Prompt]:
    return [Prompt(SimpleNamespace(id=f"p{i}"), (first, 7, 8, 9)) for i, first in enumerate(firsts)]


def test_missing_peers_are_skipped_with_a_message(cache):
    install_fake("vllm", stamp=False)   # a half-finished install counts as missing
    logs: list[str] = []
    pool = pool_for(["llama.cpp", "vllm"], logs)
    assert pool.available == [] and pool.systems(1) == [] and pool.systems(8) == []
    assert len(pool.notes) == 2 and logs == [f"peer {n}" for n in pool.notes]
    for note, venv in zip(pool.notes, ("llama-cpp", "vllm")):
        assert "skipped, not installed" in note and str(cache / "bench-peers" / venv) in note and "make bench-peers" in note
    install_fake("llama.cpp")
    gpu = pool_for(["llama.cpp"], device="cuda")
    assert gpu.available == [] and "run on the CPU" in gpu.notes[0]
    assert pool_for([]).notes == [] and pool_for(["llama.cpp"]).notes == []


def test_fake_peers_speak_the_protocol(cache):
    install_fake("llama.cpp")
    install_fake("vllm")
    pool = pool_for(["llama.cpp", "vllm"])
    try:
        assert [s.name for s in pool.systems(1)] == ["llama.cpp", "llama.cpp prompt-lookup 4", "vLLM-CPU"]
        plain, lookup, vllm = pool.systems(1)
        assert [s.name for s in pool.systems(2)] == ["llama.cpp", "vLLM-CPU"]   # prompt lookup: batch 1 only
        assert (lookup.family, lookup.drafter, lookup.k, lookup.batch1_only) == (PEER, "prompt-lookup", 4, True)

        run = pool.run(plain, prompts(4, 5, 7), 3, max_new_tokens=5)
        # cut after EOS (rows with an odd first token have EOS at position row + 1) and at max_new_tokens
        assert run.outputs == [[100, 101, 102, 103, 104], [100, 101, EOS], [100, 101, 102, EOS]]
        assert run.wall_s >= 0.05 and run.target_passes == 15 == run.row_passes
        assert run.kv_reads == pytest.approx(sum(5 * (4 + len(o) / 2) for o in run.outputs))
        llama_proc = pool.procs["llama.cpp"][1]
        load = llama_proc.info["load"]
        assert (load["model"], load["threads"], load["n_ctx"], load["dtype"]) == ("/models/tiny", 2, 512, "float32")
        assert "peer_llama" in llama_proc.info["engine"]
        pool.run(lookup, prompts(4), 1, 5)
        assert pool.procs["llama.cpp"][1] is llama_proc   # one runner across systems, repeats and batch sizes

        pool.run(vllm, prompts(4), 1, 5)
        first = pool.procs["vllm"][1]
        assert "peer_vllm" in first.info["engine"] and first.info["load"]["batch_size"] == 1
        pool.run(vllm, prompts(4), 1, 5)
        assert pool.procs["vllm"][1] is first
        pool.run(vllm, prompts(4, 6), 2, 5)
        second = pool.procs["vllm"][1]
        assert second is not first and second.info["load"]["batch_size"] == 2 and first.proc.poll() is not None
        assert any(n.startswith("llama.cpp: fake peer_llama") for n in pool.notes)
    finally:
        pool.close()
    assert all(p.proc.poll() is not None for p in (llama_proc, first, second))


@pytest.mark.parametrize("failure", ["load", "generate", "die"])
def test_a_failing_peer_is_dropped_not_fatal(cache, failure):
    install_fake("llama.cpp", env=f"FAKE_PEER_FAIL={failure}")
    logs: list[str] = []
    pool = pool_for(["llama.cpp"], logs)
    try:
        plain = pool.systems(1)[0]
        with pytest.raises(PeerError, match="fake load failure|fake generate failure|runner exited") as error:
            pool.run(plain, prompts(4), 1, 5)
        pool.fail(plain, error.value)
        assert pool.systems(1) == [] and "FAILED" in pool.notes[-1] and "FAILED" in logs[-1]
        if failure == "die":
            assert "code 3" in str(error.value)
        with pytest.raises(PeerError, match="not running"):
            pool.run(plain, prompts(4), 1, 5)
    finally:
        pool.close()


def test_cut_at_eos():
    assert cut_at_eos([5, 2, 6, 2], [2]) == [5, 2] and cut_at_eos([5, 6], [2, 3]) == [5, 6] and cut_at_eos([], [2]) == []


def _row(system: System, rate: float, spread: float, batch: int, workload: str = "mix") -> dict:
    """A result row through summarize_cell, from two runs at rate * (1 ± spread)."""
    runs = [Run([[1] * 10], 10 / (rate * (1 + s)), 10, 10, 100.0, [], []) for s in (-spread, spread)]
    row = summarize_cell(system, runs, [(1.0, 0.0)] * 2, prompts(4), {}, None, Floor(1_000_000, 100, 1e10))
    if system.family == PEER:
        row["rows_as_transformers"] = 0
    return {"workload": workload, "batch_size": batch, "mem_method": "test", **row}


def test_ratio_over_the_best_peer_and_the_tables():
    llama, vllm = System("llama.cpp", PEER, "none", 0, peer="llama.cpp"), System("vLLM-CPU", PEER, "none", 0, peer="vllm")
    lookup = System("llama.cpp prompt-lookup 10", PEER, "prompt-lookup", 10, None, True, peer="llama.cpp")
    tf, k0 = System(TRANSFORMERS, TRANSFORMERS, "none", 0), System(K0, SPECBATCH, "none", 0)
    ngram = System("specbatch ngram k=4", SPECBATCH, "ngram", 4)
    results = [_row(tf, 10, 0.01, 1), _row(llama, 30, 0.01, 1), _row(lookup, 40, 0.01, 1), _row(vllm, 20, 0.01, 1),
               _row(k0, 33, 0.01, 1), _row(ngram, 80, 0.01, 1),
               _row(tf, 50, 0.01, 8), _row(llama, 30, 0.01, 8), _row(vllm, 60, 0.5, 8), _row(k0, 90, 0.01, 8),
               _row(ngram, 45, 0.01, 8)]
    add_ratios(results)
    add_peer_ratios(results)
    by = {(r["system"], r["batch_size"]): r for r in results}
    assert by[(K0, 1)]["best_peer"] == "llama.cpp" and by[(K0, 1)]["ratio_vs_peer"] == pytest.approx(33 / 30)
    assert by[(ngram.name, 1)]["best_peer"] == lookup.name and by[(ngram.name, 1)]["ratio_vs_peer"] == pytest.approx(2)
    assert by[(K0, 8)]["best_peer"] == "vLLM-CPU" and by[(K0, 8)]["ratio_vs_peer"] == pytest.approx(1.5)
    assert by[(ngram.name, 8)]["best_peer"] == "vLLM-CPU"   # no peer speculates at batch 8: the best plain peer
    low, high = by[(ngram.name, 8)]["ratio_vs_peer_min"], by[(ngram.name, 8)]["ratio_vs_peer_max"]
    assert low < 0.75 < high and low < 1 < high   # vLLM's spread: the range straddles 1
    assert all(by[(s.name, b)]["ratio_vs_peer"] is None for s in (tf, llama, vllm) for b in (1, 8))

    meta = {"quick": False, "split": "report", "command": "specbatch bench", "date": "today", "load_at_start": 1.0,
            "platform": "linux", "machine": "x86_64", "cpu_count": 2, "device": "cpu", "torch": "2.13", "threads": 2,
            "transformers": "5", "suite": "suite", "model": "demo:smollm2", "dtype": "float32", "draft": None,
            "max_new_tokens": 10, "repeats": 2, "bandwidth_gb_s": 10.0, "weight_mb": 1.0, "kv_kb_per_token": 0.1,
            "peers": ["vLLM-CPU: skipped, not installed (no finished virtualenv at X; `make bench-peers` installs it)"]}
    text = markdown(results, meta, load_bench_config({}), 1.0)
    assert "× best peer |" in text and "vLLM-CPU: skipped, not installed" in text
    assert "| mix | 1 | specbatch k=0 | 33.0 (32.7–33.3) | 2% | 3.30 | 1.10 (llama.cpp) |" in text
    assert "| mix | 8 | specbatch ngram k=4 | 45.0 (44.5–45.5) | 2% | 0.90 | 0.75? (vLLM-CPU) |" in text
    assert "| mix | 1 | llama.cpp | 30.0 (29.7–30.3) | 2% | 3.00 | – |" in text
    assert "differs (as transformers 0/1, ref 0/0)" in text
    assert "Against the peers (mix)" in text
    assert "| specbatch k=0 | 33.0 | 1.10 (llama.cpp) | 90.0 | 1.50? (vLLM-CPU) |" in text
    assert "| llama.cpp prompt-lookup 10 | 40.0 | – | – | – |" in text


@pytest.mark.timeout(120)
def test_bench_runs_the_peers_beside_the_others(cache, model_dir, tmp_path, one_torch_thread):
    install_fake("llama.cpp")
    install_fake("vllm", env="FAKE_PEER_FAIL=load")   # installed but broken: dropped, the bench goes on
    config = tiny_bench_config(model_dir, write_suite(tmp_path / "suite"), categories=["rewriting"], mix=False,
                               batch_sizes=[1, 2], ks=[0], adaptive=False, repeats=2, passes={"enabled": False},
                               peers=["llama.cpp", "vllm"])
    out = tmp_path / "out"
    results = benchmark(load_bench_config(config), out, "specbatch bench --config tiny.yaml", log=lambda m: None)
    rows = {(r["batch_size"], r["system"]): r for r in pq.read_table(out / "results.parquet").to_pylist()}
    assert set(rows) == {(b, s) for b in (1, 2) for s in ("transformers", "llama.cpp", "specbatch k=0")} | {
        (1, "transformers prompt-lookup 4"), (1, "llama.cpp prompt-lookup 4")}
    for b in (1, 2):
        peer, ours = rows[(b, "llama.cpp")], rows[(b, "specbatch k=0")]
        assert peer["family"] == PEER and peer["repeats"] == 2 and peer["rows"] == b and peer["tokens_per_s"] > 0
        assert peer["rows_as_transformers"] == 0 and peer["target_passes"] > 0 and peer["peak_mem_mb"] is None
        assert ours["best_peer"] == "llama.cpp"
        assert ours["ratio_vs_peer"] == pytest.approx(ours["tokens_per_s"] / peer["tokens_per_s"])
    assert len(results) == len(rows)
    long = {r["system"]: r for r in json.loads(pq.read_schema(out / "results.parquet").metadata[b"specbatch_bench"])[
        "long_prefill"]}
    assert set(long) == {"specbatch", "transformers", "llama.cpp"}   # the failed vLLM is not asked again
    assert long["specbatch"]["exact"] and not long["llama.cpp"]["exact"]   # the fake's tokens are its own
    assert long["specbatch"]["ours_over_best_peer"] == pytest.approx(long["specbatch"]["tok_s"] / long["llama.cpp"]["tok_s"])
    text = (out / "results.md").read_text()
    assert "vLLM-CPU: FAILED and dropped" in text and "fake load failure" in text
    assert "llama.cpp: fake peer_llama" in text and "Against the peers (rewriting)" in text
    assert sorted(os.listdir(cache / "bench-peers" / "logs")) == ["llama-cpp.log", "vllm-b1.log", "vllm-b2.log"] or \
        sorted(os.listdir(cache / "bench-peers" / "logs")) == ["llama-cpp.log", "vllm-b1.log"]
