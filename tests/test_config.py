"""The job config: defaults, one message naming every bad key, --set overrides, secrets, fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pipeline.config_file import ConfigError, load_config
from pipeline.config_reference import HEADER, reference_table
from pipeline.job_state import changed_keys, fingerprint
from workers.config import JobConfig, config_warnings, redacted, template_fields, validation_message
from workers.storage import is_remote

REPO = Path(__file__).resolve().parents[1]
MINIMAL = {"input": {"path": "s3://bucket/prompts/"}, "output": {"path": "s3://bucket/out/"}, "model": {"target": "m"}}


def errors_of(data: dict) -> str:
    with pytest.raises(ValidationError) as info:
        JobConfig.model_validate(data)
    return validation_message(info.value)


def test_defaults_pass_their_own_validation_and_writing_them_out_changes_nothing():
    config = JobConfig.model_validate(MINIMAL)
    spelled_out = yaml.safe_load(yaml.safe_dump(config.model_dump(mode="json")))  # every default written out
    assert set(spelled_out) == set(JobConfig.model_fields)
    again = JobConfig.model_validate(spelled_out)
    assert again == config and fingerprint(again) == fingerprint(config)  # so a resume sees no change


def test_one_message_names_every_bad_key():
    message = errors_of(
        {
            "name": "no spaces allowed",
            "bogus": 1,
            "input": {"path": "p", "prompt_colum": "x", "overlong": "cut", "on_bad_file": "ignore"},
            "output": {"path": "o", "keep_columns": ["completion"]},
            "model": {"dtype": "fp8"},
            "generation": {"max_new_tokens": 0, "temperature": -1, "top_p": 0, "top_k": -1, "samples_per_prompt": 0},
            "speculation": {"k": 9},
            "resources": {"workers": 0, "gpus_per_worker": "x", "cpus_per_worker": 0, "batch_size": 0},
            "sharding": {"rows_per_shard": 0},
            "retries": {"max_attempts": 0},
        }
    )
    for key in [
        "name", "bogus: unknown key", "input.prompt_colum: unknown key", "input.overlong", "input.on_bad_file",
        "output.keep_columns", "model.target: required key is missing", "model.dtype", "generation.max_new_tokens",
        "generation.temperature", "generation.top_p", "generation.top_k", "generation.samples_per_prompt",
        "speculation.k", "resources.workers", "resources.gpus_per_worker", "resources.cpus_per_worker",
        "resources.batch_size", "sharding.rows_per_shard", "retries.max_attempts",
    ]:
        assert key in message, key
    assert message.startswith("invalid config (20 problems)")


@pytest.mark.parametrize(
    ("section", "values", "bad_key"),
    [
        ("model", {"target": "m", "drafter": "model"}, "model.draft"),
        ("model", {"target": "m", "drafter": ["suffix", "model"]}, "model.draft"),
        ("model", {"target": "m", "drafter": "suffx"}, "model.drafter"),
        ("model", {"target": "m", "drafter": []}, "model.drafter"),
        ("model", {"target": "m", "drafter": ["suffix", "suffix"]}, "model.drafter"),
        ("model", {"target": "m", "drafter": ["none", "ngram"]}, "model.drafter"),
        ("speculation", {"suffix_max_tokens": -1}, "speculation.suffix_max_tokens"),
        ("speculation", {"max_k": 65}, "speculation.max_k"),
        ("speculation", {"k": -1}, "speculation.k"),
        ("speculation", {"k": "fast"}, "speculation.k"),
        ("generation", {"max_new_tokens": "128"}, "generation.max_new_tokens"),  # wrong types are not coerced
        ("generation", {"stop": [""]}, "generation.stop.0"),
        ("resources", {"memory": 0}, "resources.memory"),
        ("input", {"path": "p", "template": "{}"}, "input.template"),
        ("input", {"path": "p", "messages_column": "m", "prompt_column": "p"}, "input.messages_column"),
        ("input", {"path": "p", "prompt_column": None}, "input.prompt_column"),
        ("output", {"path": "o", "keep_columns": ["a", "a"]}, "output.keep_columns"),
    ],
)
def test_impossible_values_are_named(section, values, bad_key):
    assert f"  {bad_key}: " in errors_of({**MINIMAL, section: values})


def test_drafter_is_a_name_or_a_list_to_compose():
    one = JobConfig.model_validate({**MINIMAL, "model": {"target": "m", "drafter": "suffix"}})
    assert one.model.drafters == ["suffix"]
    composed = JobConfig.model_validate({**MINIMAL, "model": {"target": "m", "draft": "d", "drafter": ["suffix", "model"]}})
    assert composed.model.drafters == ["suffix", "model"]
    assert JobConfig.model_validate(composed.model_dump()) == composed


def test_prompt_source_follows_messages_or_template():
    chat = JobConfig.model_validate({**MINIMAL, "input": {"path": "p", "messages_column": "messages"}})
    assert chat.input.prompt_column is None and chat.input.messages_column == "messages"
    templated = JobConfig.model_validate({**MINIMAL, "input": {"path": "p", "template": "Sum {text} {meta[a]}{text}"}})
    assert templated.input.prompt_column is None and template_fields(templated.input.template) == ["text", "meta"]
    assert JobConfig.model_validate(chat.model_dump()) == chat  # a dumped config validates again
    assert template_fields("no fields") == []


def test_identical_samples_are_warned_about_not_refused():
    def warnings(**generation) -> list[str]:
        return config_warnings(JobConfig.model_validate({"input": {"path": "x"}, "output": {"path": "o"},
                                                         "model": {"target": "m"}, "generation": generation}))

    assert warnings(samples_per_prompt=4) == [
        "generation.samples_per_prompt is 4 but generation.temperature is 0 (greedy decoding): every sample of a "
        "prompt will be the same completion; set generation.temperature above 0 for different samples"]
    assert "generation.top_k is 1" in warnings(samples_per_prompt=2, temperature=0.7, top_k=1)[0]
    assert warnings(samples_per_prompt=4, temperature=0.7) == warnings() == warnings(samples_per_prompt=1, top_k=1) == []


def test_load_config_with_overrides(tmp_path, write_yaml):
    path = write_yaml({**MINIMAL, "generation": {"temperature": 0.7}})
    config = load_config(
        path,
        [
            "speculation.k=4",
            "input.id_column=null",
            'generation.stop=["\\n", "###"]',
            "resources.gpus_per_worker=0.5",
            "output.storage_options.client_kwargs.region_name=eu-west-1",
            "sharding.rows_per_shard=10",
        ],
    )
    assert config.speculation.k == 4
    assert config.input.id_column is None
    assert config.generation.stop == ["\n", "###"]
    assert config.generation.temperature == 0.7
    assert config.resources.gpus_per_worker == 0.5
    assert config.output.storage_options == {"client_kwargs": {"region_name": "eu-west-1"}}
    assert config.sharding.rows_per_shard == 10


def test_load_config_reports_every_problem_and_where_it_was_set(tmp_path, write_yaml):
    path = write_yaml({**MINIMAL, "generation": {"top_p": 2, "max_new_token": 3}})
    with pytest.raises(ConfigError) as info:
        load_config(path, ["generation.max_new_tokenz=5", "speculation.k=99", "extra.section=1", "generation.k=2"])
    lines = str(info.value).splitlines()
    assert lines[0] == "invalid config (6 problems):"
    for line in [f"generation.top_p (in {path}): ",
                 f"generation.max_new_token (in {path}): unknown key; did you mean generation.max_new_tokens?",
                 "generation.max_new_tokenz (from --set): unknown key; did you mean generation.max_new_tokens?",
                 "speculation.k (from --set): must be between 0 and max_k (8)",
                 "extra (from --set): unknown key",
                 "generation.k (from --set): unknown key; did you mean speculation.k?"]:
        assert any(l.strip().startswith(line) for l in lines), line


def test_did_you_mean_only_when_something_is_close():
    assert "did you mean speculation?" in errors_of({**MINIMAL, "speculaton": {}})
    assert "did you mean" not in errors_of({**MINIMAL, "zzz": 1})
    assert "did you mean" not in errors_of({**MINIMAL, "input": {"path": "p", "storage_options": {}, "qqqq": 1}})


@pytest.mark.parametrize("override", ["no_equals_sign", "a..b=1", "input.path.sub=1"])
def test_malformed_overrides(tmp_path, override, write_yaml):
    with pytest.raises(ConfigError, match="--set"):
        load_config(write_yaml(MINIMAL), [override])


def test_unreadable_configs(tmp_path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(str(tmp_path / "missing.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("input:\n  path: [unclosed\n  secret: hunter2\n")
    with pytest.raises(ConfigError, match="not valid YAML at line") as info:
        load_config(str(bad))
    assert "hunter2" not in str(info.value)
    bad.write_text("- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        load_config(str(bad))


SECRETS = {
    "key": "AKIAEXAMPLEKEY",
    "secret": "very-secret-value",
    "client_kwargs": {"aws_session_token": "session-token-value", "region_name": "us-east-1"},
    "Password": "pw-value",
}


def test_redacted_hides_secrets_at_any_depth():
    config = JobConfig.model_validate(
        {
            **MINIMAL,
            "input": {"path": "s3://bucket/in/", "storage_options": SECRETS},
            "output": {"path": "https://user:pass-value@host/out/"},
        }
    )
    shown = redacted(config)
    text = str(shown)
    for secret in ["AKIAEXAMPLEKEY", "very-secret-value", "session-token-value", "pw-value", "pass-value"]:
        assert secret not in text
    client_kwargs = shown["input"]["storage_options"]["client_kwargs"]
    assert client_kwargs == {"aws_session_token": "***", "region_name": "us-east-1"}
    assert shown["generation"]["max_new_tokens"] == 128  # a number under a "token" key is a setting
    assert config.input.storage_options == SECRETS  # the config itself keeps them


def test_config_errors_never_show_secret_values(tmp_path, write_yaml):
    data = {
        **MINIMAL,
        "input": {"path": "p", "storage_options": "key=hunter2"},
        "output": {"path": "o", "aws_secret": "s3cr3t"},
    }
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(data), ["input.storage_options=token-abc"])
    message = str(info.value)
    assert "input.storage_options (from --set)" in message and "unknown key" in message and "output.aws_secret" in message
    for secret in ["hunter2", "s3cr3t", "token-abc"]:
        assert secret not in message


def test_fingerprint_tracks_output_affecting_fields_only():
    base = JobConfig.model_validate(MINIMAL)
    same = JobConfig.model_validate(
        {
            **MINIMAL,
            "resources": {"workers": 4, "batch_size": 2},
            "retries": {"max_attempts": 9},
            "input": {"path": "s3://bucket/prompts/", "storage_options": {"key": "other"}},
        }
    )
    hotter = JobConfig.model_validate({**MINIMAL, "generation": {"temperature": 0.8}})
    assert fingerprint(base) == fingerprint(same)
    assert fingerprint(base) != fingerprint(hotter)
    assert len(fingerprint(base)) == 64
    assert changed_keys(redacted(base), redacted(same)) == []
    assert changed_keys(redacted(base), redacted(hotter)) == ["generation.temperature"]
    assert changed_keys({"a": {"b": 1}}, {"a": {"c": 1}, "resources": {}}) == ["a.b", "a.c"]


def test_relative_paths_resolve_against_the_config_file_and_set_paths_against_the_cwd(tmp_path, monkeypatch):
    folder = tmp_path / "configs"
    folder.mkdir()
    path = folder / "job.yaml"
    path.write_text(yaml.safe_dump({"input": {"path": "data/in.jsonl"}, "output": {"path": "../out/"},
                                    "model": {"target": "~/models/m", "draft": "s3://b/d", "drafter": "model"}}))
    monkeypatch.chdir(tmp_path / "configs")
    config = load_config("job.yaml", ["model.draft=drafts/d"])
    assert config.input.path == str(folder / "data" / "in.jsonl")
    assert config.output.path == str(tmp_path / "out")
    assert config.model.target == "~/models/m"  # a home path is not relative to the config
    assert config.model.draft == str(folder / "drafts" / "d")  # --set: relative to the working directory
    remote = load_config(str(path), ["input.path=s3://bucket/in/", "model.target=demo:smollm2"])
    assert remote.input.path == "s3://bucket/in/" and remote.model.target == "demo:smollm2"


@pytest.mark.parametrize("file, name", [("demo", "demo"), ("synthetic", "synthetic"), ("structured", "structured"),
                                        ("cluster", "cluster-example")])
def test_shipped_job_configs_load_from_any_folder(file, name, tmp_path, monkeypatch):
    """Every job config shipped in configs/ loads the way `specbatch run` loads it, whatever the working directory."""
    monkeypatch.chdir(tmp_path)
    config = load_config(str(REPO / "configs" / f"{file}.yaml"))
    assert config.name == name
    if not is_remote(config.input.path):
        assert Path(config.input.path).is_file() and Path(config.output.path).parent == REPO / "out"


def test_the_readme_config_table_is_generated_from_the_field_descriptions():
    readme = (REPO / "README.md").read_text()
    start = readme.index(HEADER)
    assert readme[start:readme.index("\n\n", start)] == reference_table(), \
        "README's config table is stale: paste the output of `python -m pipeline.config_reference`"
