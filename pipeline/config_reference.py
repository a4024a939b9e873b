"""The README's config table, generated from the config models' own field descriptions.

`python -m pipeline.config_reference` prints it; a test keeps the README's copy equal to it.
"""
from __future__ import annotations

import json
from typing import Any

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from workers.config import JobConfig

HEADER = "| key | default | meaning |\n|---|---|---|"


def _default(field: Any) -> str:
    if field.default is PydanticUndefined and field.default_factory is None:
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default
    return f"`{value if isinstance(value, str) else json.dumps(value)}`"


def rows(model: type[BaseModel] = JobConfig, prefix: str = "") -> list[str]:
    """One table row per leaf key, in declaration order; a field without a description is an error."""
    lines = []
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel):
            lines += rows(field.annotation, f"{key}.")
            continue
        if not field.description:
            raise ValueError(f"config key {key} has no Field(description=...)")
        lines.append(f"| `{key}` | {_default(field)} | {field.description} |")
    return lines


def reference_table() -> str:
    return "\n".join([HEADER, *rows()])


if __name__ == "__main__":
    print(reference_table())
