"""The workload suite loads, is large enough, and its tune/report halves are balanced and disjoint;
the structured synthetic workload reads through the pipeline's own input path."""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import pytest

from jobs.suite import SPLITS, SuiteError, SuitePrompt, interleave, load_suite
from pipeline.config_file import load_config
from pipeline.planner import plan_shards
from workers.config import template_fields
from workers.shard_io import read_shard

REPO = Path(__file__).resolve().parents[1]
CATEGORIES = [
    "code_editing", "creative_writing", "extraction", "math_reasoning", "multi_turn",
    "question_answering", "rewriting", "structured_json", "summarisation", "translation",
]
# A paragraph at least this long is content (a passage, code, a dialogue), not a reused instruction line.
PASSAGE_CHARS = 120


@pytest.fixture(scope="module")
def suite() -> dict[str, list[SuitePrompt]]:
    return load_suite()


def test_every_category_loads_with_enough_prompts(suite):
    assert list(suite) == CATEGORIES
    for category, prompts in suite.items():
        assert len(prompts) >= 40, category
        assert all(p.category == category for p in prompts)
    assert all(p.messages and p.prompt is None for p in suite["multi_turn"])
    assert all(p.prompt and p.messages is None for c in CATEGORIES if c != "multi_turn" for p in suite[c])
    everything = [p for prompts in suite.values() for p in prompts]
    assert len({p.id for p in everything}) == len(set(everything)) == len(everything)   # hashable, ids unique


def test_split_is_tune_or_report_and_balanced(suite):
    for category, prompts in suite.items():
        counts = Counter(p.split for p in prompts)
        assert set(counts) == set(SPLITS), category
        assert abs(counts["tune"] - counts["report"]) <= 2, (category, counts)
    tune, report = load_suite("tune"), load_suite("report")
    for category in CATEGORIES:
        assert {p.split for p in tune[category]} == {"tune"} and {p.split for p in report[category]} == {"report"}
        assert len(tune[category]) + len(report[category]) == len(suite[category])


def _passages(prompt: SuitePrompt) -> set[str]:
    """The prompt's long paragraphs, whitespace- and case-normalised (chat: every message's)."""
    texts = [m["content"] for m in prompt.chat()]
    paragraphs = (p for text in texts for p in re.split(r"\n\s*\n", text))
    normal = (" ".join(p.lower().split()) for p in paragraphs)
    return {p for p in normal if len(p) >= PASSAGE_CHARS}


def test_halves_share_no_prompt_and_no_passage(suite):
    prompts = [p for ps in suite.values() for p in ps]
    by_split = {s: [p for p in prompts if p.split == s] for s in SPLITS}
    texts = {s: {json.dumps(p.chat()) for p in ps} for s, ps in by_split.items()}
    assert not texts["tune"] & texts["report"]
    passages = {s: set().union(*map(_passages, ps)) for s, ps in by_split.items()}
    assert passages["tune"] and passages["report"]
    assert not passages["tune"] & passages["report"]


def test_chat_form_of_a_plain_prompt():
    plain = SuitePrompt("x-000", "x", "tune", "Hello?", None)
    assert plain.chat() == [{"role": "user", "content": "Hello?"}]


def test_filters_and_interleave(suite):
    chosen = load_suite("report", ["translation", "math_reasoning"])
    assert list(chosen) == ["translation", "math_reasoning"]
    mixed = interleave(chosen)
    assert [p.category for p in mixed[:4]] == ["translation", "math_reasoning"] * 2
    assert sorted(p.id for p in mixed) == sorted(p.id for ps in chosen.values() for p in ps)
    assert interleave({"a": [], "b": []}) == []
    with pytest.raises(SuiteError, match="unknown categories \\['poetry'\\]"):
        load_suite(categories=["poetry"])
    with pytest.raises(SuiteError, match="split must be one of"):
        load_suite("test")


GOOD = {"id": "demo-000", "category": "demo", "split": "tune", "prompt": "Say hi."}


@pytest.mark.parametrize("bad, reason", [
    ("{not json", "not valid JSON"),
    ('["a list"]', "must be a JSON object"),
    (json.dumps({k: v for k, v in GOOD.items() if k != "split"}), "missing field(s) ['split']"),
    (json.dumps({**GOOD, "workload": "x"}), "unknown field(s) ['workload']"),
    (json.dumps({**GOOD, "split": "test"}), "split must be one of"),
    (json.dumps({**GOOD, "category": "other"}), "does not match the file name"),
    (json.dumps({**GOOD, "id": "other-001"}), "id must be a string 'demo-NNN'"),
    (json.dumps({**GOOD, "prompt": " "}), "prompt must be a non-empty string"),
    (json.dumps({**GOOD, "messages": [{"role": "user", "content": "hi"}]}), "exactly one of 'prompt' or 'messages'"),
    (json.dumps({**{k: v for k, v in GOOD.items() if k != "prompt"},
                 "messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]}),
     "the last message must be the user's"),
    (json.dumps({**{k: v for k, v in GOOD.items() if k != "prompt"}, "messages": [{"role": "bot", "content": "x"}]}),
     "messages[0] must be"),
    (json.dumps(GOOD), "id 'demo-000' already used at"),
])
def test_malformed_row_names_file_and_line(tmp_path, bad, reason):
    path = tmp_path / "demo.jsonl"
    path.write_text(json.dumps(GOOD) + "\n\n" + bad + "\n")
    with pytest.raises(SuiteError) as info:
        load_suite(root=tmp_path)
    assert str(info.value).startswith(f"{path}:3: ")
    assert reason in str(info.value)


def test_empty_root_is_refused(tmp_path):
    with pytest.raises(SuiteError, match="no suite files"):
        load_suite(root=tmp_path)


def test_structured_workload_reads_through_the_pipeline():
    """configs/structured.yaml validates as the CLI loads it, and every row of its input renders a prompt."""
    records = REPO / "configs" / "data" / "structured_records.jsonl"
    config = load_config(str(REPO / "configs" / "structured.yaml"), [f"input.path={records}"])
    assert config.generation.temperature == 0.0 and config.model.drafter == "ngram"
    assert set(template_fields(config.input.template)) == {"product", "category", "persona", "usage"}
    plan = plan_shards(config)
    rows = [row for spec in plan.shards for row in read_shard(spec, config.input, config.output.keep_columns)]
    source = [json.loads(line) for line in records.read_text().splitlines()]
    assert len(rows) == len(source) >= 200 and not [r.error for r in rows if r.error]
    assert [r.id for r in rows] == [s["id"] for s in source]
    assert len({s["product"] for s in source}) == len(source)
    for row, record in zip(rows, source):
        assert record["product"] in row.prompt and '"pros"' in row.prompt
        assert row.keep == {"category": record["category"]}


def test_plan_mix_job_is_ten_report_prompts_of_each_category_read_as_chat_messages():
    """configs/plan-mix.yaml (the README's `specbatch plan` check) holds the first ten report-half prompts of every
    category, as the suite has them, and every row reads through the pipeline as chat messages."""
    config = load_config(str(REPO / "configs" / "plan-mix.yaml"))
    rows = [row for spec in plan_shards(config).shards for row in read_shard(spec, config.input, config.output.keep_columns)]
    assert len(rows) == 100 and not [r.error for r in rows if r.error]
    suite = load_suite("report")
    by_id = {p.id: p for prompts in suite.values() for p in prompts}
    assert {r.id for r in rows} == {p.id for prompts in suite.values() for p in prompts[:10]}
    for row in rows:
        source = by_id[row.id]
        assert row.keep == {"category": source.category}
        assert row.messages == (source.messages or [{"role": "user", "content": source.prompt}])
