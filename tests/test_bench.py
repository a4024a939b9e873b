"""`specbatch bench` on tiny random models and tiny suites: the config's properties, the suite feeding the
cells, the interleaving order, the spread verdicts, the roofline arithmetic, and runs end to end.

Speed is not tested here (the benchmark itself measures it); these tests check that the bench runs,
that its exactness column is honest and that its verdicts follow from its numbers.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import save_model_dir, tiny_draft, tiny_llama, tiny_tokenizer
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from jobs import gpu_check
from jobs.bench import benchmark, run_bench
from jobs.bench.cells import schedule
from jobs.bench.config import BenchError, load_bench_config, resolve_device
from jobs.bench.goals import goal_rows
from jobs.bench.long_prefill import long_prompts
from jobs.bench.oracle import fit_costs, oracle_rate, run_rate
from jobs.bench.report import COLUMNS
from jobs.bench.roofline import Floor, kv_bytes_per_token, measure_bandwidth, weight_bytes
from jobs.bench.spread import INCONCLUSIVE, MET, NOT_MET, ratio_range, verdict
from jobs.bench.systems import bench_systems
from jobs.bench.workloads import MIX, Prompt, build_workloads, cell_rows, skipped_cells
from jobs.suite import load_suite
from workers.engine.controller import StepRecord
from workers.registry import encode_prompt

CONFIGS = Path(__file__).parents[1] / "configs"


def write_suite(root: Path, per_category: int = 4) -> Path:
    """Two categories of `per_category` prompts per split (ids alternate tune/report), one a conversation."""
    root.mkdir(parents=True, exist_ok=True)
    texts = ["rewrite this sentence politely please: the quick brown fox jumps over the lazy dog",
             "why is the sky blue?", "def add(a, b): return a + b", "extract the names and dates from the text below"]
    for category in ("rewriting", "multi_turn"):
        rows = []
        for i in range(2 * per_category):
            text = f"{texts[i % len(texts)]} {i}"
            source = ({"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "hi there"},
                                    {"role": "user", "content": text}]} if category == "multi_turn" else {"prompt": text})
            rows.append({"id": f"{category}-{i:03d}", "category": category, "split": ("tune", "report")[i % 2], **source})
        (root / f"{category}.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return root


def tiny_bench_config(model_dir: str, suite: Path, **over) -> dict:
    config = {
        "model": {"target": model_dir, "dtype": "float32"},
        "suite": str(suite),
        "threads": 1,
        "batch_sizes": [1, 2],
        "ks": [0, 2],
        "max_k": 4,
        "max_new_tokens": 12,
        "repeats": 2,
        "warmup_tokens": 2,
        "reference_rows": 2,
        "prompt_lookup_num_tokens": 4,
        "pipeline": {"enabled": False},
        "passes": {"batch_sizes": [1, 2], "widths": [1, 3], "repeats": 2},
        "prefill": {"lengths": [40], "repeats": 2},
        "peers": [],   # installed peers (make bench-peers) are no part of these tests: tests/test_peers.py fakes them
    }
    return {**config, **over}


def work(cfg) -> int:
    """Tokens a config asks for: systems x workloads x rows x max_new_tokens x repeats over its batch sizes."""
    workloads = len(cfg.categories or load_suite(cfg.split, root=cfg.suite)) + cfg.mix
    return sum(len(bench_systems(cfg, b)) * workloads * cfg.rows(b) * cfg.max_new_tokens * cfg.repeats
               for b in cfg.batch_sizes)


@pytest.mark.parametrize("name", ["bench.yaml", "bench-gpu.yaml"])
def test_quick_config_validates_and_asks_for_less(name):
    full, quick = load_bench_config(CONFIGS / name), load_bench_config(CONFIGS / name, quick=True)
    assert Path(full.suite).is_dir() and full.split == "report"   # relative to the config file, from any folder
    assert work(quick) < work(full) / 4
    assert {s.name for b in quick.batch_sizes for s in bench_systems(quick, b)} <= \
        {s.name for b in full.batch_sizes for s in bench_systems(full, b)}
    assert load_bench_config(CONFIGS / name, quick=True, split="tune").split == "tune"


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("bench*.yaml")), ids=lambda p: p.name)
def test_every_bench_config_validates_on_the_report_half(path):
    cfg = load_bench_config(path)
    assert Path(cfg.suite).is_dir() and cfg.split == "report" and cfg.max_new_tokens >= 24


def test_config_refuses_what_cannot_run():
    with pytest.raises(BenchError, match="ks must lie"):
        load_bench_config({"ks": [0, 9], "max_k": 8})
    with pytest.raises(BenchError, match="batch_sizess"):
        load_bench_config({"batch_sizess": [1]})
    with pytest.raises(BenchError, match=r"\['nope', 'ngram\+nope'\] are not registered.*ngram"):
        load_bench_config({"drafters": ["ngram", "nope", "ngram+nope"]})
    with pytest.raises(BenchError, match="model.draft"):
        load_bench_config({"drafters": ["model"]})
    with pytest.raises(BenchError, match="at least as many rows as its batch size"):
        load_bench_config({"batch_sizes": [4], "rows_by_batch": {4: 2}})


def test_drafters_become_systems_by_name():
    cfg = load_bench_config({"drafters": ["ngram", "model", "suffix+ngram"], "model": {"draft": "some-draft"},
                             "ks": [0, 4]})
    names = [s.name for s in bench_systems(cfg, 4)]
    assert names == ["transformers", "specbatch k=0", "specbatch ngram k=4", "specbatch model k=4",
                     "specbatch suffix+ngram k=4", "specbatch ngram adaptive", "specbatch model adaptive",
                     "specbatch suffix+ngram adaptive"]
    assisted = {"transformers prompt-lookup 10", "transformers draft heuristic", "transformers draft constant"}
    assert {s.name for s in bench_systems(cfg, 1)} == set(names) | assisted   # assisted generation: batch 1 only


def test_suite_feeds_the_cells(tmp_path):
    suite = write_suite(tmp_path / "suite")
    tokenizer = tiny_tokenizer()
    cfg = load_bench_config({"suite": str(suite), "batch_sizes": [1, 2, 4]})
    workloads = build_workloads(cfg, tokenizer)
    assert list(workloads) == ["multi_turn", "rewriting", MIX]
    report = load_suite("report", root=suite)
    for category, prompts in report.items():
        assert [p.id for p in workloads[category]] == [p.id for p in prompts[:4]]   # the report half, in order
        for p in workloads[category]:
            assert list(p.ids) == encode_prompt(tokenizer, p.source.prompt, p.source.messages, True)
    assert [p.source.category for p in workloads[MIX]] == ["multi_turn", "rewriting"] * 2   # interleaved
    assert [p.id for p in cell_rows(workloads["rewriting"], cfg, 2)] == [p.id for p in workloads["rewriting"][:2]]
    tune = build_workloads(load_bench_config({"suite": str(suite), "split": "tune", "mix": False, "batch_sizes": [1]}),
                           tokenizer)
    assert {p.source.split for prompts in tune.values() for p in prompts} == {"tune"} and MIX not in tune
    big = load_bench_config({"suite": str(suite), "batch_sizes": [1, 8]})   # 4 report prompts per category
    workloads = build_workloads(big, tokenizer)
    assert skipped_cells(big, workloads) == ["multi_turn b=8 (4 prompts)", "rewriting b=8 (4 prompts)"]
    assert len(cell_rows(workloads[MIX], big, 8)) == 8   # the mix fills what no category can


def test_repeats_interleave_round_by_round():
    systems = bench_systems(load_bench_config({}), 4)
    order = schedule(systems, 3)
    assert [r for r, _ in order] == sorted(r for r, _ in order)   # repeat-major: a round ends before the next
    rounds = [[s.name for r, s in order if r == i] for i in range(3)]
    assert all(sorted(r) == sorted(s.name for s in systems) for r in rounds)   # every system once per round
    assert len({r[0] for r in rounds}) == 3   # rotated: no system always runs first


def test_spread_decides_verdicts():
    assert ratio_range((110, 100, 120), (100, 95, 105)) == pytest.approx((1.1, 100 / 105, 120 / 95))
    assert verdict(1.01, 1.20, ">=", 0.97, repeats=2) == MET
    assert verdict(0.80, 0.95, ">=", 0.97, repeats=2) == NOT_MET
    assert verdict(0.90, 1.30, ">=", 0.97, repeats=2) == INCONCLUSIVE   # the spread swamps the margin
    assert verdict(1.5, 1.5, ">=", 0.97, repeats=1) == INCONCLUSIVE     # one repeat: the spread is unknown

    def row(system: str, rate: float, low: float, high: float) -> dict:
        return {"section": "generation", "workload": "rewriting", "batch_size": 1, "system": system,
                "tokens_per_s": rate, "tokens_per_s_min": low, "tokens_per_s_max": high, "floor_fraction": None}

    cfg = load_bench_config({"ks": [0, 2], "batch_sizes": [1]})
    steady = [row("specbatch k=0", 10, 9.9, 10.1), row("specbatch ngram k=2", 12, 11.9, 12.1)]
    goals = {g.check: g for g in goal_rows(steady + [row("specbatch ngram adaptive", 12.5, 12.4, 12.6)], cfg)}
    assert goals["rewriting b=1: ngram adaptive / best fixed k"].verdict == MET
    noisy = {g.check: g for g in goal_rows(steady + [row("specbatch ngram adaptive", 12.5, 6.0, 19.0)], cfg)}
    check = noisy["rewriting b=1: ngram adaptive / best fixed k"]
    assert check.value == pytest.approx(12.5 / 12) and check.verdict == INCONCLUSIVE
    assert noisy["rewriting b=1: ngram adaptive / transformers prompt lookup"].verdict is None   # did not run


def traced(drafted: list[int], accepted: list[int]) -> StepRecord:
    """A step of rows offered 4 each, priced as the test's machine does: verify 1 + 0.1 per further column at
    2 rows, 0.5 + 0.3 per column at 1 row, and drafting 0.1 s a column."""
    n, width = len(drafted), 1 + max(drafted)
    verify = (1.0 + 0.1 * (width - 1)) if n == 2 else (0.5 + 0.3 * (width - 1))
    return StepRecord(np.full(n, 4), np.array(drafted), np.array(accepted), width, 0.1 * (width - 1), verify)


def test_the_trace_oracle_picks_each_steps_width_for_the_best_rate_of_the_whole_trace():
    """A hand-made trace with a known optimum (seconds per width: 1 + 0.2 per column at 2 rows, 0.5 + 0.4 at 1):
    step 1 accepts 4 in one row, 0 in the other (width 5: 6 tokens in 1.8 s); step 2 one draft accepted (width
    2: 3 tokens in 1.2 s); step 3 only rejected drafts (width 1: 2 tokens in 1 s); step 4, one row whose one
    accepted draft adds a token for 0.4 s, which raises that step's own rate (2/0.9 over 1/0.5) but not the
    trace's (12/4.5 over 13/4.9): the oracle leaves it at width 1."""
    calibration = [traced([w - 1] * n, [0] * n) for n in (1, 2) for w in range(1, 6)]   # every width measured
    reference = [traced([4, 4], [4, 0]), traced([0, 1], [0, 1]), traced([2, 0], [0, 0]), traced([1], [1])]
    costs = fit_costs([calibration, reference])
    assert costs.draft_per_column == pytest.approx(0.1)
    assert oracle_rate(reference, costs, max_k=4) == pytest.approx(12 / 4.5)
    assert run_rate(reference, costs) == pytest.approx(13 / (1.8 + 1.2 + 1.4 + 0.9))
    assert run_rate(reference, costs, controller_s=0.7) == pytest.approx(13 / (1.8 + 1.2 + 1.4 + 0.9 + 0.7))
    assert oracle_rate(reference[:1], costs, max_k=2) == pytest.approx(4 / 1.4)   # widths above 3 are not candidates
    assert oracle_rate([], costs, max_k=4) == 0.0


def test_roofline_arithmetic_on_a_tiny_model():
    untied = tiny_llama(320, layers=2, hidden=64, dtype=torch.float32)
    params = sum(p.numel() * 4 for p in untied.parameters())
    assert weight_bytes(untied) == params - 320 * 64 * 4   # a pass reads only its tokens' embedding rows
    tied = LlamaForCausalLM(LlamaConfig(vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True))
    assert weight_bytes(tied) == sum(p.numel() * 4 for p in tied.parameters())   # the head is the embedding
    per_token = kv_bytes_per_token(untied.config, torch.float32)
    assert per_token == 2 * 2 * 2 * (64 // 4) * 4   # K and V x layers x kv heads x head dim x fp32
    assert kv_bytes_per_token(untied.config, torch.bfloat16) == per_token // 2

    floor = Floor(weights=1_000_000, kv_per_token=1_000, bandwidth=1e9)
    cell = floor.per_pass(passes=10, kv_reads=5_000, wall_s=0.05)   # 500 cached tokens read per pass
    assert cell["bytes_per_pass"] == 1_500_000
    assert cell["floor_ms_per_pass"] == pytest.approx(1.5) and cell["ms_per_pass"] == pytest.approx(5.0)
    assert cell["floor_fraction"] == pytest.approx(0.3)
    assert 1e8 < measure_bandwidth(torch.device("cpu"), repeats=2, mb=64) < 1e13


@pytest.mark.timeout(240)
def test_bench_runs_end_to_end(model_dir, tmp_path, capsys, one_torch_thread):
    cfg = load_bench_config(tiny_bench_config(model_dir, write_suite(tmp_path / "suite"), drafters=["ngram", "suffix+ngram"]))
    out = tmp_path / "out"
    results = benchmark(cfg, out, "specbatch bench --config tiny.yaml", log=lambda message: None)

    for name in ("results.parquet", "traces.parquet", "results.md", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == len(results) and list(rows[0]) == COLUMNS
    ours = {"specbatch k=0", "specbatch ngram k=2", "specbatch ngram adaptive", "specbatch suffix+ngram k=2",
            "specbatch suffix+ngram adaptive"}
    expected = {(w, b, s) for w in ("multi_turn", "rewriting", MIX) for b in (1, 2) for s in ours | {"transformers"}}
    expected |= {(w, 1, "transformers prompt-lookup 4") for w in ("multi_turn", "rewriting", MIX)}
    assert {(r["workload"], r["batch_size"], r["system"]) for r in rows} == expected

    mine = [r for r in rows if r["family"] == "specbatch"]
    assert all(r["rows_as_k0"] == r["rows"] and r["rows_matching"] == r["rows_checked"] > 0 for r in mine), \
        [(r["workload"], r["batch_size"], r["system"]) for r in mine if r["rows_as_k0"] != r["rows"]]
    assert all(r["rows"] == r["batch_size"] and r["repeats"] == 2 for r in rows)
    assert all(r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] for r in rows)
    assert all(r["spread"] == pytest.approx((r["tokens_per_s_max"] - r["tokens_per_s_min"]) / r["tokens_per_s"])
               for r in rows)
    assert all(r["ratio_vs_transformers_min"] <= r["ratio_vs_transformers"] <= r["ratio_vs_transformers_max"]
               for r in rows)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for r in rows:   # every pass reads at least the weights, and the floor fraction is floor time / pass time
        assert r["bytes_per_pass"] > weight_bytes(model)
        assert r["floor_fraction"] == pytest.approx(r["floor_ms_per_pass"] / r["ms_per_pass"])
        assert r["ms_per_pass"] == pytest.approx(1e3 * r["wall_s"] / r["target_passes"])
    fixed2 = [r for r in mine if r["k"] == 2]
    assert all(len(r["accept_by_position"]) == 2 and sum(r["k_hist"]) == r["target_passes"] for r in fixed2)
    assert all(r["controller_ms_per_step"] > 0 and r["modelled_tokens_per_s"] > 0 for r in mine)
    assert all(r["controller_ms_per_step"] is None for r in rows if r["family"] != "specbatch")
    # the oracle is computed on the widest fixed k's steps (k=2 here): that run's own steps never beat it
    assert all(r["modelled_tokens_per_s"] <= r["oracle_tokens_per_s"] * (1 + 1e-9) for r in fixed2)
    assert all((r["oracle_tokens_per_s"] is None) == (r["k"] == 0) for r in mine)
    steps = pq.read_table(out / "traces.parquet").to_pylist()
    for r in mine:   # the median run's every step: one target pass each
        key = (r["workload"], r["batch_size"], r["system"])
        cell = [s for s in steps if (s["workload"], s["batch_size"], s["system"]) == key]
        assert len(cell) == r["target_passes"] and all(s["width"] == 1 + max(s["drafted"]) for s in cell)

    passes = json.loads(pq.read_schema(out / "results.parquet").metadata[b"specbatch_bench"])["passes"]
    assert [(p["batch_size"], p["width"]) for p in passes] == [(1, 1), (1, 3), (2, 1), (2, 3)]
    for p in passes:   # one pass reads the weights at least: never under the floor
        assert p["ms"] > 0 and p["transformers_ms"] > 0 and 0 < p["floor_fraction"] == pytest.approx(p["floor_ms"] / p["ms"])
        assert p["vs_width_1"] == pytest.approx(p["ms"] / next(q["ms"] for q in passes if q["batch_size"] == p["batch_size"]
                                                                   and q["width"] == 1))
        assert (p["width"] == 1) == (p.get("prefill_tok_s", 0) > 0 and p.get("transformers_prefill_tok_s", 0) > 0)

    long = json.loads(pq.read_schema(out / "results.parquet").metadata[b"specbatch_bench"])["long_prefill"]
    assert {r["system"] for r in long} == {"specbatch", "transformers"} and all(r["exact"] for r in long)
    assert all(r["min_s"] <= r["first_token_s"] <= r["max_s"] and r["tok_s"] == pytest.approx(40 / r["first_token_s"])
               for r in long)

    text = (out / "results.md").read_text()
    assert "| prompt tokens | system | first token s (min–max) |" in text
    assert "specbatch bench --config tiny.yaml" in text and "report half" in text and "% floor" in text
    assert "| prefill tok/s | transformers prefill tok/s |" in text
    assert "Goals (issues 12 and 13)" in text and "| rewriting | 1 | specbatch k=0 |" in text
    assert "| controller ms/step |" in text and "| adaptive ÷ best fixed | modelled | adaptive ÷ oracle |" in text
    assert text in capsys.readouterr().out   # the table is printed too


@pytest.mark.timeout(300)
def test_bench_draft_model_and_pipeline_via_cli(model_dir, tmp_path, one_torch_thread):
    """With a draft model: transformers' assisted generation (both schedules) and our model drafter run and
    stay exact; the pipeline row runs the job through Ray and ShardRunner alone; the CLI writes the files."""
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    draft_dir = str(save_model_dir(tmp_path / "draft", tiny_draft(target), tiny_tokenizer()))
    config = tiny_bench_config(model_dir, write_suite(tmp_path / "suite"), categories=["rewriting"], batch_sizes=[1],
                               ks=[2], repeats=1, model={"target": model_dir, "draft": draft_dir, "dtype": "float32"},
                               drafters=["model"], pipeline={"enabled": True, "workload": "mix", "copies": 2,
                                                            "batch_size": 2, "rows_per_shard": 2, "k": 2})
    config_file = tmp_path / "bench.yaml"
    config_file.write_text(json.dumps(config))   # JSON is YAML
    out = tmp_path / "out"
    assert run_bench(argparse.Namespace(config=str(config_file), quick=False, out=str(out))) == 0
    rows = pq.read_table(out / "results.parquet").to_pylist()
    gen = {(r["workload"], r["system"]): r for r in rows if r["section"] == "generation"}
    assert {s for _, s in gen} == {"transformers", "transformers prompt-lookup 4", "transformers draft heuristic",
                                   "transformers draft constant", "specbatch model k=2", "specbatch model adaptive"}
    assert all(r["rows_matching"] == r["rows_checked"] for r in gen.values())
    assert gen[("rewriting", "specbatch model k=2")]["accept_by_position"][0] > 0
    pipe = {r["system"]: r for r in rows if r["section"] == "pipeline"}
    assert set(pipe) == {"specbatch job on Ray (run_job)", "ShardRunner alone"}
    assert all(r["rows"] == 2 and r["rows_matching"] == r["rows_checked"] == 2 for r in pipe.values())
    ray_row = pipe["specbatch job on Ray (run_job)"]
    assert ray_row["ratio_vs_direct"] > 0 and ray_row["generated_tokens"] == pipe["ShardRunner alone"]["generated_tokens"]
    assert "Pipeline:" in (out / "results.md").read_text()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is present")
def test_cuda_config_is_refused_without_a_gpu(tmp_path, capsys):
    with pytest.raises(BenchError, match="no CUDA device"):
        resolve_device("cuda")
    code = run_bench(argparse.Namespace(config=str(CONFIGS / "bench-gpu.yaml"), quick=True, out=str(tmp_path / "o")))
    assert code == 2 and "device: cuda" in capsys.readouterr().err


TINY_SHAPE = {"model_type": "llama", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 300, "max_position_embeddings": 512,
              "initializer_range": 0.2}


def test_gpu_check_parts_run_on_a_tiny_shape(one_torch_thread):
    """The GPU script's three parts, tried on the CPU with a tiny random shape: exactness of the captured and
    eager steps against transformers, tokens/s captured against eager, and the pass-cost table."""
    cpu = torch.device("cpu")
    exact = gpu_check.exactness(cpu, rows=3, max_new=6, shape=TINY_SHAPE)
    assert {(r["step"], r["batch"]) for r in exact} == {(s, b) for s in ("captured", "eager") for b in (1, 16)}
    assert all(r["equal"] == r["rows"] == 3 for r in exact)
    speed = gpu_check.decoding_speed(cpu, [1, 2], 4, shape=TINY_SHAPE)
    assert [r["batch"] for r in speed] == [1, 2] and all(r["captured_tok_s"] > 0 and r["eager_tok_s"] > 0 for r in speed)
    passes = gpu_check.pass_costs(cpu, TINY_SHAPE, [1, 2], [1, 4], context=16, repeats=1)
    assert len(passes) == 2 * 2 * 2 and all(r["ms"] > 0 and r["floor_ms"] > 0 for r in passes)
    table = gpu_check.markdown({"device": "cpu", "shape": "custom", "exactness": exact, "speed": speed, "passes": passes})
    assert "| captured | 2 | 4 |" in table and "3/3" in table


def test_long_prompts_are_consecutive_slices_of_the_suite_cycled_when_short():
    source = SimpleNamespace(id="p")
    workloads = {"a": [Prompt(source, (1, 2, 3))], "b": [Prompt(source, (4, 5))]}
    prompts = long_prompts(workloads, 4, 3)
    assert [p.ids for p in prompts] == [(1, 2, 3, 4), (5, 1, 2, 3), (4, 5, 1, 2)]
    with pytest.raises(ValueError, match="needs prompts"):
        long_prompts({"a": []}, 4, 1)
