"""Weights loaded without transformers (engine/checkpoint.py) decode exactly as transformers' own model does,
and a worker that loads them and its tokenizer never imports transformers."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM

from tests.tiny_models import save_model_dir, tiny_llama, tiny_tokenizer
from workers.engine.cached_lm import CachedLM
from workers.engine.checkpoint import CheckpointLM, mapped, readable
from workers.engine.decoding_model import DecodingModel
from workers.models import load_model, load_tokenizer

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def tiny_qwen2(vocab_size: int) -> Qwen2ForCausalLM:
    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=50000.0, tie_word_embeddings=True,
                         eos_token_id=2, initializer_range=0.2)
    return Qwen2ForCausalLM(config).eval()


def tied_llama(vocab_size: int) -> LlamaForCausalLM:
    torch.manual_seed(2)
    config = LlamaConfig(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, tie_word_embeddings=True, attention_bias=True,
                         initializer_range=0.2, eos_token_id=2)
    return LlamaForCausalLM(config).eval()


def shard(folder) -> None:
    """Split model.safetensors into two files with an index, as large checkpoints are stored."""
    weights = load_file(folder / "model.safetensors")
    names = sorted(weights)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, keys in parts.items():
        save_file({k: weights[k].contiguous() for k in keys}, folder / file, metadata={"format": "pt"})
    (folder / "model.safetensors").unlink()
    index = {"metadata": {}, "weight_map": {k: file for file, keys in parts.items() for k in keys}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


@pytest.mark.parametrize("make,sharded", [(lambda v: tiny_llama(v, dtype=torch.float32), False),
                                          (tied_llama, True), (tiny_qwen2, False)],
                         ids=["llama", "llama-tied-biased-sharded", "qwen2-tied"])
def test_checkpoint_decodes_exactly_as_the_transformers_model(make, sharded, tmp_path):
    tokenizer = tiny_tokenizer()
    model = make(len(tokenizer))
    folder = save_model_dir(tmp_path / "m", model, tokenizer)
    if sharded:
        shard(folder)
    assert readable(folder)
    ours = load_model(str(folder), "float32", torch.device("cpu"), transformers_model=False)
    theirs = load_model(str(folder), "float32", torch.device("cpu"))
    assert isinstance(ours, CheckpointLM) and not isinstance(theirs, CheckpointLM)
    assert ours.generation_config.eos_token_id == theirs.generation_config.eos_token_id
    assert (ours.lm_head.weight.data_ptr() == ours.model.embed_tokens.weight.data_ptr()) == model.config.tie_word_embeddings
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13]]
    logits = []
    for source in (ours, theirs):
        lm = CachedLM(DecodingModel.prepare(source), max_rows=2, capacity=64)
        lm.prefill(prompts, 0)
        logits.append(lm.logits(torch.tensor([[p[-1], 30, 31] for p in prompts])))
    assert torch.equal(logits[0], logits[1])
    positions = torch.arange(300).view(2, 150)
    for mine, reference in zip(ours.model.rotary_emb(logits[0], positions), theirs.model.rotary_emb(logits[0], positions)):
        assert torch.equal(mine, reference)
    with torch.no_grad():
        full = theirs(torch.tensor([prompts[0] + [30, 31]])).logits[0, -3:]
    torch.testing.assert_close(logits[0][0], full, rtol=1e-5, atol=1e-5)


def test_mapped_tensors_are_views_of_the_file_equal_to_safetensors_own_load(tmp_path):
    tensors = {"a": torch.randn(3, 5), "b": torch.randn(7).to(torch.bfloat16), "c": torch.arange(6).view(2, 3),
               "empty": torch.zeros(0, 4), "mask": torch.tensor([True, False])}
    save_file(tensors, tmp_path / "t.safetensors", metadata={"format": "pt"})
    ours, theirs = mapped(tmp_path / "t.safetensors"), load_file(tmp_path / "t.safetensors")
    assert ours.keys() == theirs.keys()
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name])
    raw = (tmp_path / "t.safetensors").read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    # one mapping, not copies: each tensor sits where the file puts it, relative to the others
    assert ours["c"].data_ptr() - ours["a"].data_ptr() == header["c"]["data_offsets"][0] - header["a"]["data_offsets"][0]
    ours["a"][0, 0] = 99.0  # copy-on-write: the file stays as it was
    assert torch.equal(mapped(tmp_path / "t.safetensors")["a"], theirs["a"])


@pytest.mark.parametrize("change", [{"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64}},
                                    {"mlp_bias": True}, {"model_type": "mistral"}, {"hidden_act": "gelu"},
                                    {"architectures": ["LlamaForSequenceClassification"]}])
def test_checkpoints_it_does_not_reproduce_go_through_transformers(change, tmp_path):
    folder = save_model_dir(tmp_path / "m", tiny_llama(320, dtype=torch.float32), tiny_tokenizer())
    assert readable(folder) and not readable(folder, trust_remote_code=True)
    config = json.loads((folder / "config.json").read_text())
    config.pop("rope_parameters", None)
    (folder / "config.json").write_text(json.dumps({**config, **change}))
    assert not readable(folder)


def test_the_direct_tokenizer_is_the_one_autotokenizer_gives(model_dir):
    ours, theirs = load_tokenizer(model_dir), AutoTokenizer.from_pretrained(model_dir)
    assert type(ours) is type(theirs)
    text = "The quick brown fox, 12 apples and <|im_end|> too."
    assert ours(text)["input_ids"] == theirs(text)["input_ids"]
    chat = [{"role": "user", "content": text}]
    assert (ours.apply_chat_template(chat, add_generation_prompt=True, tokenize=True)
            == theirs.apply_chat_template(chat, add_generation_prompt=True, tokenize=True))


def test_a_worker_never_imports_transformers(model_dir):
    """Start-up: transformers' modeling code takes longer to import than a small model takes to load, and
    importing transformers at all about a second (the tokenizer: workers/tokenizer.py)."""
    script = f"""
import sys, torch
from workers.config import JobConfig
from workers.registry import load_models
config = JobConfig.model_validate({{"input": {{"path": "in.jsonl"}}, "output": {{"path": "out"}},
                                    "model": {{"target": "{model_dir}", "drafter": "ngram"}}}})
models = load_models(config, torch.device("cpu"))
assert type(models.target.model).__name__ == "CheckpointLM" and type(models.tokenizer).__name__ == "Tokenizer"
print(sorted(m for m in sys.modules if m.startswith("transformers")))
"""
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.strip() == "[]"
