"""Loading a job config (YAML plus --set overrides) and telling whether two configs give the same output."""

from __future__ import annotations

import hashlib
import json
from typing import Any

import yaml
from pydantic import ValidationError

from workers.config import JobConfig, redacted, validation_message
from workers.storage import read_bytes, safe_url

# Sections and keys that change how a job runs but not what it writes: resume ignores them.
_RUN_ONLY_SECTIONS = ("resources", "retries")
_RUN_ONLY_KEYS = ("storage_options",)


class ConfigError(ValueError):
    """The config cannot be used; the message names every bad key and never a secret value."""


def load_config(path: str, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML config (a local path or any fsspec URL), apply `dotted.key=value` overrides, validate.

    Override values are parsed as YAML, so `speculation.k=4`, `input.id_column=null` and
    `generation.stop=["\\n"]` give an int, None and a list. Unknown keys, from the file or an
    override, are reported by validation with all other problems in one ConfigError.
    """
    shown = safe_url(path)
    try:
        data = yaml.safe_load(read_bytes(path)) or {}
    except FileNotFoundError:
        raise ConfigError(f"{shown}: no such config file") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{shown}: not valid YAML{_yaml_position(exc)}") from None
    if not isinstance(data, dict):
        raise ConfigError(f"{shown}: the config must be a mapping of sections, not {type(data).__name__}")
    for override in overrides or []:
        apply_override(data, override)
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(f"{shown}: {validation_message(exc)}") from None


def _yaml_position(exc: yaml.YAMLError) -> str:
    """Where a YAML error is, without quoting the line (it may hold a secret)."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None)
    where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
    return f"{where}: {problem}" if problem else where


def apply_override(data: dict[str, Any], override: str) -> None:
    """Set data[a][b][c] = yaml(value) for "a.b.c=value", creating missing sections."""
    key, sep, text = override.partition("=")
    parts = key.strip().split(".")
    if not sep or not all(parts):
        raise ConfigError(f"--set {key!r}: expected dotted.key=value")
    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML{_yaml_position(exc)}") from None
    node = data
    for depth, part in enumerate(parts[:-1]):
        if node.get(part) is None:  # absent, or an empty YAML section
            node[part] = {}
        node = node[part]
        if not isinstance(node, dict):
            raise ConfigError(f"--set {key}: {'.'.join(parts[: depth + 1])} is not a section")
    node[parts[-1]] = value


def _output_fields(config_dict: dict[str, Any]) -> dict[str, Any]:
    """The parts of a (redacted) config dict that determine the job's output."""

    def strip(node: Any) -> Any:
        if isinstance(node, dict):
            return {k: strip(v) for k, v in node.items() if k not in _RUN_ONLY_KEYS}
        return node

    return {k: strip(v) for k, v in config_dict.items() if k not in _RUN_ONLY_SECTIONS}


def fingerprint(config: JobConfig) -> str:
    """sha256 of the canonical JSON of everything that affects the output; resume refuses a change."""
    canonical = json.dumps(_output_fields(redacted(config)), sort_keys=True, separators=(",", ":"))
    return hashlib.sha256(canonical.encode()).hexdigest()


def changed_keys(old: dict[str, Any], new: dict[str, Any]) -> list[str]:
    """Dotted paths of the output-affecting keys that differ between two redacted config dicts."""
    return _diff(_output_fields(old), _output_fields(new), "")


def _diff(old: Any, new: Any, prefix: str) -> list[str]:
    if isinstance(old, dict) and isinstance(new, dict):
        changed = []
        for key in sorted(old.keys() | new.keys()):
            path = f"{prefix}.{key}" if prefix else key
            if key not in old or key not in new:
                changed.append(path)
            else:
                changed += _diff(old[key], new[key], path)
        return changed
    return [] if old == new else [prefix]
