"""The job config: defaults, one message naming every bad key, --set overrides, secrets, fingerprints."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml
from pydantic import ValidationError

from pipeline.job_config import ConfigError, changed_keys, fingerprint, load_config
from workers.config import JobConfig, redacted, template_fields, validation_message

MINIMAL = {"input": {"path": "s3://bucket/prompts/"}, "output": {"path": "s3://bucket/out/"}, "model": {"target": "m"}}


def write_yaml(tmp_path, data: dict) -> str:
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def errors_of(data: dict) -> str:
    with pytest.raises(ValidationError) as info:
        JobConfig.model_validate(data)
    return validation_message(info.value)


def test_defaults():
    config = JobConfig.model_validate(MINIMAL)
    assert config.name == "demo"
    assert config.input.model_dump() == {
        "path": "s3://bucket/prompts/",
        "prompt_column": "prompt",
        "messages_column": None,
        "id_column": "id",
        "template": None,
        "storage_options": {},
        "overlong": "truncate",
        "on_bad_file": "fail",
        "duplicate_ids": "error",
    }
    assert config.output.keep_columns == [] and config.output.storage_options == {}
    assert config.model.model_dump() == {
        "target": "m", "draft": None, "drafter": "ngram", "dtype": "auto", "trust_remote_code": False,
    }
    assert config.generation.model_dump() == {
        "max_new_tokens": 128, "temperature": 0.0, "top_p": 1.0, "top_k": 0, "seed": 0,
        "samples_per_prompt": 1, "stop": [], "chat_template": True,
    }
    assert config.speculation.model_dump() == {"k": "adaptive", "max_k": 8, "ngram_size": 3}
    assert config.resources.model_dump() == {
        "workers": 1, "gpus_per_worker": "auto", "cpus_per_worker": 1, "memory": None, "batch_size": 16,
    }
    assert config.sharding.rows_per_shard == 256 and config.retries.max_attempts == 3


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


def test_prompt_source_follows_messages_or_template():
    chat = JobConfig.model_validate({**MINIMAL, "input": {"path": "p", "messages_column": "messages"}})
    assert chat.input.prompt_column is None and chat.input.messages_column == "messages"
    templated = JobConfig.model_validate({**MINIMAL, "input": {"path": "p", "template": "Sum {text} {meta[a]}{text}"}})
    assert templated.input.prompt_column is None and template_fields(templated.input.template) == ["text", "meta"]
    assert JobConfig.model_validate(chat.model_dump()) == chat  # a dumped config validates again
    assert template_fields("no fields") == []


def test_load_config_with_overrides(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "generation": {"temperature": 0.7}})
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


def test_load_config_reports_every_problem_including_overrides(tmp_path):
    path = write_yaml(tmp_path, {**MINIMAL, "generation": {"top_p": 2}})
    with pytest.raises(ConfigError) as info:
        load_config(path, ["generation.max_new_tokenz=5", "speculation.k=99", "extra.section=1"])
    message = str(info.value)
    assert message.startswith(path)
    for key in ["generation.top_p", "generation.max_new_tokenz: unknown key", "speculation.k", "extra: unknown key"]:
        assert key in message


@pytest.mark.parametrize("override", ["no_equals_sign", "a..b=1", "input.path.sub=1"])
def test_malformed_overrides(tmp_path, override):
    with pytest.raises(ConfigError, match="--set"):
        load_config(write_yaml(tmp_path, MINIMAL), [override])


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


def test_config_errors_never_show_secret_values(tmp_path):
    data = {
        **MINIMAL,
        "input": {"path": "p", "storage_options": "key=hunter2"},
        "output": {"path": "o", "aws_secret": "s3cr3t"},
    }
    with pytest.raises(ConfigError) as info:
        load_config(write_yaml(tmp_path, data), ["input.storage_options=token-abc"])
    message = str(info.value)
    assert "input.storage_options" in message and "output.aws_secret: unknown key" in message
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


@pytest.mark.parametrize("file, name", [("demo", "demo"), ("synthetic", "synthetic"), ("structured", "structured"),
                                        ("cluster", "cluster-example")])
def test_shipped_job_configs_validate(file, name):
    """Every job config shipped in configs/ loads the way `specbatch run` loads it."""
    config = load_config(str(Path(__file__).resolve().parents[1] / "configs" / f"{file}.yaml"))
    assert config.name == name
