"""Reading a job config file: YAML plus --set overrides, validated into a JobConfig."""

from __future__ import annotations

import copy
import os
from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from workers.config import JobConfig, validation_message
from workers.model_paths import DEMO_MODEL
from workers.storage import is_remote, read_bytes, safe_url


# Config keys that hold a path to local or remote data; relative local ones are relative to the config file.
PATH_KEYS = ("input.path", "output.path", "model.target", "model.draft")


class ConfigError(ValueError):
    """The config cannot be used; the message names every bad key and never a secret value."""


def load_config(path: str, overrides: list[str] | None = None) -> JobConfig:
    """Read a YAML config (a local path or any fsspec URL), apply `dotted.key=value` overrides, validate.

    Relative local paths in a local config file resolve against the file's folder, so a config works
    from any working directory; paths given with --set resolve against the working directory, like any
    command-line path. Either way they are absolute from here on, so every line that shows one can be
    used from anywhere. Override values are parsed as YAML, so `speculation.k=4`, `input.id_column=null` and
    `generation.stop=["\\n"]` give an int, None and a list. Unknown keys, from the file or an
    override, are reported by validation with all other problems in one ConfigError, each naming
    where it was set: the file or --set.
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
    if not is_remote(path):
        _resolve_paths(data, Path(path.removeprefix("file://")).expanduser().resolve().parent)
    from_file = copy.deepcopy(data)
    for override in overrides or []:
        apply_override(data, override)
    set_keys = [o.partition("=")[0].strip() for o in overrides or []]
    _resolve_paths(data, Path.cwd(), [key for key in PATH_KEYS if _set_by(key, set_keys, from_file)])
    try:
        return JobConfig.model_validate(data)
    except ValidationError as exc:
        def source(key: str) -> str:
            return " (from --set)" if _set_by(key, set_keys, from_file) else f" (in {shown})"

        raise ConfigError(validation_message(exc, source)) from None


def _resolve_paths(data: dict[str, Any], folder: Path, keys: tuple[str, ...] | list[str] = PATH_KEYS) -> None:
    """Make the relative local paths under `keys` absolute, relative to `folder`."""
    for key in keys:
        section, name = key.split(".")
        node = data.get(section)
        value = node.get(name) if isinstance(node, dict) else None
        if isinstance(value, str) and value and not is_remote(value) and value != DEMO_MODEL \
                and not value.startswith("file://") and not Path(value).expanduser().is_absolute():
            node[name] = os.path.normpath(folder / value)


def _set_by(key: str, set_keys: list[str], from_file: dict[str, Any]) -> bool:
    """Whether --set gave this key: the key itself, a section above it, or a key below it that the file lacks."""
    for given in set_keys:
        if key == given or key.startswith(given + "."):
            return True
        if given.startswith(key + ".") and not _in(from_file, key.split(".")):
            return True
    return False


def _in(data: Any, parts: list[str]) -> bool:
    for part in parts:
        if not isinstance(data, dict) or part not in data:
            return False
        data = data[part]
    return True


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
