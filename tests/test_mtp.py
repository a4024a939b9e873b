"""The MTP draft head on a tiny random Llama target: shared tensors, distillation, save/load, mismatches.

The head is distilled in seconds on the target's own greedy completions of a tiny corpus. Acceptance is
scored on its training prompts (a random target's continuations of unseen prompts carry nothing to learn).
"""
from __future__ import annotations

import json
import random

import pytest
import torch

from jobs.cli import main
from pipeline.driver import JobFailed, run_job
from tests.pipeline_helpers import make_config, prompts, read_output
from tests.test_generator import hf_greedy
from tests.tiny_models import StubTokenizer, save_model_dir, tiny_llama, tiny_tokenizer
from workers.engine.controller import AdaptiveK, FixedK
from workers.engine.decoding_model import DecodingModel
from workers.engine.drafter import NoDrafter
from workers.engine.generator import GenerationSettings, Request, SpeculativeGenerator
from workers.engine.mtp_drafter import CachedHead, DraftHead, MTPDrafter
from workers.engine.sampling import SamplingParams
from workers.mtp_distill import (
    Example,
    TrainSettings,
    _collate,
    acceptance,
    frequent_tokens,
    target_features,
    train,
    unroll,
)
from workers.mtp_head import (
    HeadMismatch,
    HeadSpec,
    MTPHead,
    load_head,
    read_report,
    save_head,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def tok():
    return tiny_tokenizer()


@pytest.fixture(scope="module")
def target(tok):
    return tiny_llama(len(tok), seed=0, dtype=torch.float32)


@pytest.fixture(scope="module")
def examples(tok, target):
    """Greedy completions of 40 random prompts, with the target's features."""
    rng = random.Random(0)
    prompts = [[rng.randrange(3, len(tok)) for _ in range(rng.randrange(3, 12))] for _ in range(40)]
    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, NoDrafter(), FixedK(0),
                                     GenerationSettings(max_new_tokens=32, batch_size=8, max_k=0))
    done = generator.generate([Request(str(i), p, 0) for i, p in enumerate(prompts)]).completions
    return target_features(target, [(p, d.token_ids) for p, d in zip(prompts, done)])


@pytest.fixture(scope="module")
def trained(target, examples):
    """Heads distilled for a few seconds: full vocabulary and a reduced one."""
    heads = {}
    for name, vocab in (("full", None), ("reduced", frequent_tokens(examples, 160, target.config.vocab_size))):
        heads[name] = new_head(target, vocab)
        train(heads[name], examples, examples[:4], TrainSettings(seconds=120, max_steps=100, batch_tokens=512,
                                                                  eval_every_s=1e9), progress=False)
    return heads


def test_the_draft_vocabulary_ranks_completions_then_prompts_then_fills_with_low_ids():
    ids = lambda xs: torch.tensor(xs)  # noqa: E731
    rows = [Example(ids([50, 60, 60, 7, 7, 7]), torch.zeros(6, 2), ids([0] * 6), start=3),  # completion 7 7 7
            Example(ids([60, 9, 8, 8]), torch.zeros(4, 2), ids([0] * 4), start=2)]           # completion 8 8
    assert frequent_tokens(rows, 2, 100).tolist() == [7, 8]
    assert frequent_tokens(rows, 3, 100).tolist() == [7, 8, 60]          # then the prompts' most frequent
    assert frequent_tokens(rows, 7, 100).tolist() == [0, 1, 7, 8, 9, 50, 60]  # then the lowest ids not in
    assert frequent_tokens(rows, 0, 100) is None and frequent_tokens(rows, 100, 100) is None


def new_head(target, draft_vocab: torch.Tensor | None = None, seed: int = 0) -> MTPHead:
    torch.manual_seed(seed)
    spec = HeadSpec.for_target(target, "tiny", n_layers=1, draft_vocab=0 if draft_vocab is None else len(draft_vocab))
    head = MTPHead(spec, target)
    if draft_vocab is not None:
        head.vocab_ids.copy_(draft_vocab)
    return head


def test_features_are_the_targets_own(target, examples):
    e = examples[0]
    with torch.no_grad():
        assert torch.equal(target(input_ids=e.tokens[None]).logits[0].argmax(-1), e.greedy)
        # the state the LM head reads (after the final norm), as the verify pass hands it to the drafter
        assert torch.allclose(target.get_decoder()(input_ids=e.tokens[None]).last_hidden_state[0], e.hidden, atol=1e-5)
    # greedy data: the target's choice at each completion position is the token it then emitted
    assert torch.equal(e.greedy[e.start - 1 : -1], e.tokens[e.start :])


def test_head_shares_the_targets_embedding_norm_and_lm_head(target):
    head = new_head(target)
    assert head.shared.embed.data_ptr() == target.get_input_embeddings().weight.data_ptr()
    assert head.shared.norm.data_ptr() == target.get_decoder().norm.weight.data_ptr()
    assert head.shared.head.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    shared = {target.get_input_embeddings().weight.data_ptr(), target.get_output_embeddings().weight.data_ptr()}
    assert not shared & {p.data_ptr() for p in head.parameters()}, "the head must not train the target's tensors"
    assert not [name for name in head.state_dict() if "embed" in name or "lm_head" in name]
    d = target.config.hidden_size
    own = 2 * d * d + 2 * d + sum(p.numel() for p in target.get_decoder().layers[0].parameters())
    assert sum(p.numel() for p in head.parameters()) == own  # projection, two norms, one block: nothing else


def test_training_unroll_matches_chained_drafting(target, examples):
    """Depth 2 of the training unroll is exactly what drafting computes (on the fused decoder, through its
    laid-out weights): real entries up to the anchor in the head's cache, then one chained step on the head's
    own state."""
    head = new_head(target).eval()
    e, depth = examples[3], 2
    batch = _collate([e], depth, torch.device("cpu"))
    with torch.no_grad():
        states = unroll(head, batch, depth)
    anchor = e.start + 2
    drafting = CachedHead(DraftHead.prepare(head, DecodingModel.prepare(target)), 1, len(e.tokens) + depth)
    first = drafting.forward(e.hidden[None, : anchor + 1], e.tokens[None, 1 : anchor + 2])
    drafting.advance(torch.tensor([anchor + 1]))
    chained = drafting.forward(first[:, -1:], e.tokens[None, anchor + 2 : anchor + 3])
    assert torch.allclose(first[0, -1], states[0][0, anchor], atol=1e-5)
    assert torch.allclose(chained[0, 0], states[1][0, anchor], atol=1e-5)


@pytest.mark.parametrize("reduced", [False, True])
def test_distilled_head_beats_an_untrained_one(target, examples, reduced):
    vocab = frequent_tokens(examples, 160, target.config.vocab_size) if reduced else None
    head = new_head(target, vocab)
    before = acceptance(head, examples)
    result = train(head, examples, examples[:4], TrainSettings(seconds=120, max_steps=150, batch_tokens=512,
                                                                eval_every_s=1e9), progress=False)
    after = acceptance(head, examples)
    assert result.steps == 150 and result.curve[-1]["step"] == 150
    assert after[0] > 0.6 and after[0] > before[0] + 0.4, (before, after)
    assert after[1] > before[1], "the chained position learned too"
    if reduced:
        assert head.logits(torch.zeros(1, target.config.hidden_size)).shape == (1, len(vocab))


def test_training_stops_when_heldout_acceptance_stops_improving(target, examples):
    """With a zero learning rate nothing improves: after `patience` evaluations training stops and says why."""
    result = train(new_head(target), examples, examples[:4], TrainSettings(seconds=120, lr=0.0, batch_tokens=512,
                                                                           eval_every_s=0.0, patience=2), progress=False)
    assert result.steps == 3 and result.stopped.startswith("held-out acceptance stopped improving")
    assert result.kept_step == 1  # no evaluation beat the first one after training began
    assert [point["step"] for point in result.curve] == [0, 1, 2, 3] and result.curve[0]["loss"] is None


def test_training_keeps_the_weights_with_the_best_heldout_acceptance(target, examples):
    head, probe = new_head(target), examples[30:]
    result = train(head, examples[:30], probe, TrainSettings(seconds=120, max_steps=25, lr=3e-3, batch_tokens=256,
                                                             eval_every_s=0.0, patience=0), progress=False)
    best = max(point["heldout_accept_1"] for point in result.curve[1:])
    assert acceptance(head, probe, positions=1)[0] == pytest.approx(best)
    assert result.curve[[p["step"] for p in result.curve].index(result.kept_step)]["heldout_accept_1"] == pytest.approx(best)


@pytest.mark.parametrize("where", ["local", "s3"])
def test_save_load_round_trip(target, examples, tmp_path, s3, where, request):
    head = new_head(target, frequent_tokens(examples, 40, target.config.vocab_size), seed=1)
    url, options = str(tmp_path / "head"), None
    if where == "s3":
        url, options = request.getfixturevalue("s3_bucket") + "/heads/tiny", s3.storage_options
    save_head(head, url, {"steps": 3}, options)
    loaded = load_head(url, target, options)
    assert loaded.spec == head.spec and torch.equal(loaded.vocab_ids, head.vocab_ids)
    assert loaded.shared.head.data_ptr() == target.get_output_embeddings().weight.data_ptr()
    e = examples[0]
    batch = _collate([e], 2, torch.device("cpu"))
    with torch.no_grad():
        for mine, theirs in zip(unroll(head.eval(), batch, 2), unroll(loaded, batch, 2)):
            assert torch.equal(head.logits(mine), loaded.logits(theirs))
    assert read_report(url, options) == {"steps": 3}


def test_a_head_for_another_target_fails_before_generation(target, tok, tmp_path):
    save_head(new_head(target), str(tmp_path / "head"), {})
    narrower = tiny_llama(len(tok), hidden=32, dtype=torch.float32)
    with pytest.raises(HeadMismatch, match=r"hidden size 64, vocabulary 320.*hidden size 32, vocabulary 320"):
        load_head(str(tmp_path / "head"), narrower)
    other_vocab = tiny_llama(len(tok) + 8, dtype=torch.float32)
    with pytest.raises(HeadMismatch, match=r"vocabulary 320.*vocabulary 328"):
        load_head(str(tmp_path / "head"), other_vocab)
    with pytest.raises(FileNotFoundError, match="holds no MTP head"):
        load_head(str(tmp_path / "nothing"), target)


@pytest.mark.timeout(120)
def test_distill_command_writes_a_loadable_head(model_dir, tmp_path, write_input, capsys):
    rng = random.Random(1)
    words = "the quick brown fox jumps over lazy dog rewrite sentence please names dates sky blue".split()
    rows = [{"id": f"p{i}", "prompt": " ".join(rng.choices(words, k=rng.randrange(3, 9)))} for i in range(40)]
    source = write_input(str(tmp_path / "prompts.jsonl"), rows)
    config = tmp_path / "job.yaml"
    config.write_text(json.dumps({"input": {"path": source}, "output": {"path": str(tmp_path / "out")},
                                  "model": {"target": model_dir}, "generation": {"max_new_tokens": 16},
                                  "resources": {"batch_size": 4}}))
    out = tmp_path / "head"
    assert main(["distill", str(config), "--minutes", "0", "--out", str(out), "--quiet"]) == 1
    assert "needs completions of both training and held-out prompts; got 0" in capsys.readouterr().err
    assert main(["distill", str(config), "--minutes", "2", "--steps", "20", "--out", str(out), "--quiet",
                 "--heldout", "0.25", "--draft-vocab", "64"]) == 0
    report = read_report(str(out))
    assert report["steps"] == 20 and report["workload"]["heldout_sequences"] > 0
    assert report["workload"]["train_sequences"] + report["workload"]["heldout_sequences"] == 40
    assert len(report["heldout_accept_by_position"]) == 4 and report["curve"][-1]["step"] == 20
    assert report["stopped"] == "step limit reached (20 steps)"
    assert report["curve"][0] == {**report["curve"][0], "step": 0, "loss": None}, "no loss before the first step"
    conditional, unconditional = report["heldout_accept_by_position"], report["heldout_reach_by_position"]
    assert unconditional[0] == pytest.approx(conditional[0]) and unconditional[1] <= conditional[1] + 1e-9
    assert unconditional[1] == pytest.approx(conditional[0] * conditional[1], abs=0.05)
    assert set(report["speed"]) == {"batch_1", "batch_4"}
    assert report["speed"]["batch_1"]["expected"]["cost_ratio"] > 0 and report["speed"]["batch_4"]["prefill_ms"] > 0
    out_text = capsys.readouterr().out
    assert "saved to" in out_text and "stopped: step limit reached" in out_text and "conditional" in out_text
    from workers.models import load_model

    assert load_head(str(out), load_model(model_dir, "float32", torch.device("cpu"))).spec.draft_vocab <= 64


@pytest.mark.parametrize("batch_size", [1, 3])
@pytest.mark.parametrize("k", [1, 2, 4, "adaptive"])
@pytest.mark.parametrize("vocab", ["full", "reduced"])
def test_greedy_with_the_head_equals_transformers_generate(tok, target, examples, trained, vocab, k, batch_size):
    prompts = [e.tokens[: e.start].tolist() for e in examples[:5]] + [tok("why is the sky")["input_ids"], [5]]
    references = [hf_greedy(target, p, 20) for p in prompts]
    controller = AdaptiveK(4, batch_size) if k == "adaptive" else FixedK(k)
    generator = SpeculativeGenerator(DecodingModel.prepare(target), tok, MTPDrafter(DecodingModel.prepare(target), trained[vocab], SamplingParams()),
                                     controller, GenerationSettings(max_new_tokens=20, batch_size=batch_size, max_k=4))
    result = generator.generate([Request(str(i), p, i) for i, p in enumerate(prompts)])
    assert [c.token_ids for c in result.completions] == references
    stats = result.stats
    if k != "adaptive":  # adaptive k may rightly draft little in 20 tokens; a fixed k always drafts
        assert stats.accepted_by_position[0] > 0.2 * stats.attempted_by_position[0] > 0, "the head should draft well here"


def test_a_long_prompt_admitted_beside_a_row_near_its_end():
    """The catch-up pads every row to the longest pending run, here the new row's whole prompt, while the
    other row's head cache is nearly full: the padding must find room, and the output stay the target's."""
    target = tiny_llama(16, seed=1, hidden=32)
    target.generation_config.eos_token_id = None  # every row runs its 30 tokens
    rng = random.Random(0)
    requests = [Request(str(n), [rng.randrange(16) for _ in range(n)], 0) for n in (20, 20, 25)]
    decoding = DecodingModel.prepare(target)
    settings = GenerationSettings(max_new_tokens=30, batch_size=2, max_k=2)
    outputs = []
    for drafter, k in ((NoDrafter(), 0), (MTPDrafter(decoding, new_head(target), SamplingParams()), 2)):
        generator = SpeculativeGenerator(decoding, StubTokenizer(), drafter, FixedK(k), settings)
        outputs.append([c.token_ids for c in generator.generate(requests).completions])
    assert outputs[0] == outputs[1]


@pytest.mark.timeout(240)
@pytest.mark.usefixtures("local_ray")
def test_the_loop_run_distill_from_the_output_rerun_with_the_head(model_dir, tmp_path, write_input, capsys):
    """A first job, `specbatch distill --from` its output, the same job again with the head: same output,
    which is transformers' greedy output."""
    path = write_input(str(tmp_path / "in.jsonl"), prompts(24))
    first = make_config(model_dir, path, str(tmp_path / "first"), generation={"max_new_tokens": 16})
    run_job(first, progress=False)
    config_file = tmp_path / "job.yaml"
    config_file.write_text(json.dumps(first.model_dump(mode="json")))
    head = str(tmp_path / "head")
    assert main(["distill", str(config_file), "--from", first.output.path, "--out", head, "--minutes", "2",
                 "--steps", "30", "--heldout", "0.2", "--quiet"]) == 0
    assert read_report(head)["workload"]["source"].startswith("job output")
    second = make_config(model_dir, path, str(tmp_path / "second"), generation={"max_new_tokens": 16},
                         model={"drafter": "mtp", "draft": head})
    run_job(second, progress=False)
    tokens = lambda config: {r["id"]: r["completion_token_ids"] for r in read_output(config)}  # noqa: E731
    assert tokens(second) == tokens(first)
    rows = read_output(second)
    assert sum(r["drafted_tokens"] for r in rows) > 0 and {r["drafter"] for r in rows} == {"mtp"}
    from workers.models import load_model, load_tokenizer
    from workers.registry import encode_prompt

    target, tok = load_model(model_dir, "float32", torch.device("cpu")), load_tokenizer(model_dir)
    for row in rows[:3]:
        assert row["completion_token_ids"] == hf_greedy(target, encode_prompt(tok, row["prompt"], None, True), 16)
    other = tiny_tokenizer()
    narrower = save_model_dir(tmp_path / "narrower", tiny_llama(len(other), hidden=32, dtype=torch.float32), other)
    mismatched = make_config(str(narrower), path, str(tmp_path / "third"), model={"drafter": "mtp", "draft": head})
    with pytest.raises(JobFailed, match="hidden size 64.*hidden size 32"):
        run_job(mismatched, progress=False)
    assert not (tmp_path / "third" / "data").exists()
    missing = make_config(model_dir, path, str(tmp_path / "fourth"), model={"drafter": "mtp", "draft": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match="holds no MTP head"):
        run_job(missing, progress=False)
