"""`specbatch bench` machinery on a tiny random model: every system runs, our outputs are exact, files are written.

Speed is not tested here (the benchmark itself measures it); these tests check that the bench
runs end to end, that its exactness column is honest, and that its config is read as documented.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from tiny_models import save_model_dir, tiny_draft, tiny_tokenizer
from transformers import AutoModelForCausalLM

from jobs.bench import (
    COLUMNS,
    BenchError,
    benchmark,
    load_bench_config,
    resolve_device,
    run_bench,
)

PROMPTS = [
    {"id": "r0", "workload": "rewriting",
     "prompt": "rewrite this sentence politely please: the quick brown fox jumps over the lazy dog"},
    {"id": "o0", "workload": "open", "prompt": "why is the sky blue?"},
]


@pytest.fixture(scope="module")
def draft_dir(model_dir, tmp_path_factory) -> str:
    target = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    return str(save_model_dir(tmp_path_factory.mktemp("tiny-draft"), tiny_draft(target), tiny_tokenizer()))


def tiny_bench_config(model_dir: str, draft_dir: str | None, prompts: Path, **over) -> dict:
    config = {
        "model": {"target": model_dir, "draft": draft_dir, "dtype": "float32"},
        "device": "cpu",
        "prompts": str(prompts),
        "workloads": ["rewriting", "open", "mix"],
        "batch_sizes": [1, 2],
        "ks": [0, 2],
        "adaptive": True,
        "max_k": 4,
        "drafters": ["ngram", "model"] if draft_dir else ["ngram"],
        "max_new_tokens": 16,
        "repeats": 1,
        "warmup_tokens": 2,
        "prompt_lookup_num_tokens": 4,
        "pipeline": {"enabled": False},
    }
    config.update(over)
    return config


@pytest.fixture
def prompt_file(tmp_path) -> Path:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(p) + "\n" for p in PROMPTS))
    return path


@pytest.mark.timeout(120)
def test_bench_runs_every_system_and_ours_match_greedy(model_dir, prompt_file, tmp_path, capsys):
    # one prompt per workload, cycled to 2 rows so that batch 2 is full; batch-1 cells run the first row only
    cfg = load_bench_config(tiny_bench_config(model_dir, None, prompt_file, min_rows_per_workload=2,
                                              max_rows_by_batch={1: 1}))
    out = tmp_path / "out"
    results = benchmark(cfg, out, "specbatch bench --config tiny.yaml", log=lambda message: None)

    for name in ("results.parquet", "results.md", "plot.png"):
        assert (out / name).stat().st_size > 0, name
    rows = pq.read_table(out / "results.parquet").to_pylist()
    assert len(rows) == len(results) and set(COLUMNS) <= set(rows[0])
    cells = {(r["workload"], r["batch_size"], r["system"]) for r in rows}
    ours = {"specbatch k=0", "specbatch ngram k=2", "specbatch ngram adaptive"}
    expected = {(w, b, s) for w in cfg.workloads for b in (1, 2) for s in ours | {"transformers"}}
    expected |= {(w, 1, "transformers prompt-lookup 4") for w in cfg.workloads}  # assisted: batch 1 only
    assert cells == expected

    mine = [r for r in rows if r["family"] == "specbatch"]
    assert all(r["matches_greedy"] and r["rows_matching"] == r["rows"] for r in mine), \
        [(r["workload"], r["batch_size"], r["system"]) for r in mine if not r["matches_greedy"]]
    assert all(r["generated_tokens"] > 0 and r["tokens_per_s"] > 0 for r in rows)
    assert all(r["tokens_per_s_min"] <= r["tokens_per_s"] <= r["tokens_per_s_max"] for r in rows)
    assert all(r["target_passes"] > 0 and r["tokens_per_row_pass"] >= 1.0 - 1e-9 for r in rows)
    plain = [r for r in rows if r["system"] == "transformers"]
    assert all(r["ratio_vs_transformers"] == pytest.approx(1.0) for r in plain)
    assert all(r["peak_mem_mb"] > 0 for r in rows)
    assert all(r["rows"] == r["batch_size"] for r in rows)
    fixed2 = [r for r in mine if r["k"] == 2]
    assert all(len(r["accept_by_position"]) == 2 and sum(r["k_hist"]) == r["target_passes"] and len(r["k_hist"]) == 3
               for r in fixed2)  # k_hist counts passes by the k used (k shrinks near a row's budget)

    text = (out / "results.md").read_text()
    assert "specbatch bench --config tiny.yaml" in text and "torch" in text and "| rewriting | 1 | specbatch k=0 |" in text
    assert text in capsys.readouterr().out  # the table is printed too


@pytest.mark.timeout(240)
def test_bench_draft_model_and_pipeline_via_cli(model_dir, draft_dir, prompt_file, tmp_path):
    """With a draft model: transformers' assisted generation (both schedules) and our model drafter run,
    ours stay exact; the pipeline row runs the job through Ray and ShardRunner alone; the CLI writes the files."""
    config = tiny_bench_config(model_dir, draft_dir, prompt_file, workloads=["mix"], batch_sizes=[1], ks=[2],
                               drafters=["model"], pipeline={"enabled": True, "workload": "mix", "copies": 2,
                                                            "batch_size": 2, "rows_per_shard": 2, "k": 2})
    config_file = tmp_path / "bench.yaml"
    config_file.write_text(json.dumps(config))  # JSON is YAML
    out = tmp_path / "out"
    assert run_bench(argparse.Namespace(config=str(config_file), quick=False, out=str(out))) == 0
    rows = pq.read_table(out / "results.parquet").to_pylist()
    gen = {r["system"]: r for r in rows if r["section"] == "generation"}
    assert set(gen) == {"transformers", "transformers prompt-lookup 4", "transformers draft heuristic",
                        "transformers draft constant", "specbatch model k=2", "specbatch model adaptive"}
    assert gen["specbatch model k=2"]["matches_greedy"] and gen["specbatch model adaptive"]["matches_greedy"]
    assert gen["specbatch model k=2"]["accept_by_position"][0] > 0
    pipe = {r["system"]: r for r in rows if r["section"] == "pipeline"}
    assert set(pipe) == {"specbatch job on Ray (run_job)", "ShardRunner alone"}
    assert all(r["rows"] == 4 and r["matches_greedy"] and r["tokens_per_s"] > 0 for r in pipe.values())
    ray_row = pipe["specbatch job on Ray (run_job)"]
    assert ray_row["ratio_vs_direct"] > 0 and ray_row["generated_tokens"] == pipe["ShardRunner alone"]["generated_tokens"]
    assert "Pipeline:" in (out / "results.md").read_text()


def test_config_quick_section_and_checks(tmp_path):
    full = load_bench_config(Path(__file__).parents[1] / "configs" / "bench.yaml")
    quick = load_bench_config(Path(__file__).parents[1] / "configs" / "bench.yaml", quick=True)
    assert full.batch_sizes == [1, 4, 16] and full.max_new_tokens == 96 and full.repeats == 2
    assert quick.batch_sizes == [1, 4] and quick.ks == [0, 2, 8] and quick.repeats == 1
    assert quick.pipeline.enabled and quick.pipeline.batch_size == 4 and quick.pipeline.k == "adaptive"
    gpu = load_bench_config(Path(__file__).parents[1] / "configs" / "bench-gpu.yaml")
    assert gpu.device == "cuda" and gpu.model.dtype == "bfloat16" and gpu.batch_sizes == [1, 16, 64, 128]
    with pytest.raises(BenchError, match="ks must lie"):
        load_bench_config({"ks": [0, 9], "max_k": 8})
    with pytest.raises(BenchError, match="batch_sizess"):
        load_bench_config({"batch_sizess": [1]})
    with pytest.raises(BenchError, match="model.draft"):
        load_bench_config({"drafters": ["model"]})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the refusal where no GPU is present")
def test_cuda_config_is_refused_without_a_gpu(tmp_path, capsys):
    with pytest.raises(BenchError, match="no CUDA device"):
        resolve_device("cuda")
    code = run_bench(argparse.Namespace(config=str(Path(__file__).parents[1] / "configs" / "bench-gpu.yaml"), quick=True, out=str(tmp_path / "o")))
    assert code == 2 and "device: cuda" in capsys.readouterr().err
