"""The job config: one pydantic model per YAML section.

It lives in workers/ because both sides read it: the driver validates it before anything starts,
and each worker reads its rows and writes its output from the same object. Every model forbids
unknown keys and runs in strict mode, so a typo or a wrong type is reported instead of guessed.
"""

from __future__ import annotations

import re
import string
from typing import Annotated, Any, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    PlainValidator,
    ValidationError,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from workers.schemas import OUTPUT_SCHEMA
from workers.storage import safe_url

_SECRET_KEY = re.compile(r"key|secret|token|password|credential|session", re.IGNORECASE)
REDACTED = "***"


def _either(word: str, kind: type[int] | tuple[type, ...], minimum: float, label: str) -> Any:
    """A validator for "WORD or a number >= minimum" that reports one error, not one per union arm."""

    def check(value: Any) -> Any:
        if value == word:
            return value
        if isinstance(value, bool) or not isinstance(value, kind) or value < minimum:
            raise ValueError(f"must be '{word}' or {label} >= {minimum:g}")
        return float(value) if isinstance(kind, tuple) and float in kind else value  # 1 -> 1.0 for float fields

    return PlainValidator(check)


def _key_error(key: str, reason: str) -> PydanticCustomError:
    """A cross-field error that validation_message reports under section.key, not the section."""
    return PydanticCustomError("bad_key", "{reason}", {"key": key, "reason": reason})


def template_fields(template: str) -> list[str]:
    """The row columns a prompt template reads ("{text} {meta[x]}" -> ["text", "meta"])."""
    roots = []
    for _, field, _, _ in string.Formatter().parse(template):
        if field is None:
            continue
        root = re.split(r"[.\[]", field, maxsplit=1)[0]
        if not root or root.isdigit():
            raise ValueError("template fields must name columns, e.g. {text}; positional {} is not allowed")
        if root not in roots:
            roots.append(root)
    return roots


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class InputConfig(_Section):
    path: str
    prompt_column: str | None = "prompt"
    messages_column: str | None = None
    id_column: str | None = "id"
    template: str | None = None
    storage_options: dict[str, Any] = Field(default_factory=dict)
    overlong: Literal["truncate", "error"] = "truncate"
    on_bad_file: Literal["fail", "skip"] = "fail"
    duplicate_ids: Literal["error", "suffix"] = "error"

    @field_validator("template")
    @classmethod
    def _template_parses(cls, template: str | None) -> str | None:
        if template is not None:
            template_fields(template)
        return template

    @model_validator(mode="after")
    def _one_prompt_source(self) -> InputConfig:
        # prompt_column has a default: giving messages_column or template replaces it unless the
        # user also set prompt_column explicitly, which is a conflict.
        if "prompt_column" not in self.model_fields_set and (self.messages_column or self.template):
            self.prompt_column = None
        given = [k for k in ("prompt_column", "messages_column", "template") if getattr(self, k)]
        if not given:
            raise _key_error("prompt_column", "one of prompt_column, messages_column or template must give the prompt")
        if len(given) > 1:
            reason = f"conflicts with input.{given[0]}: set exactly one of prompt_column, messages_column, template"
            raise _key_error(given[1], reason)
        return self


class OutputConfig(_Section):
    path: str
    storage_options: dict[str, Any] = Field(default_factory=dict)
    keep_columns: list[str] = Field(default_factory=list)

    @field_validator("keep_columns")
    @classmethod
    def _no_collisions(cls, columns: list[str]) -> list[str]:
        clashes = sorted(set(columns) & set(OUTPUT_SCHEMA.names))
        if clashes:
            raise ValueError(f"{clashes} collide with output columns; rename them in the input")
        if len(set(columns)) != len(columns):
            raise ValueError("lists a column twice")
        return columns


class ModelConfig(_Section):
    target: str
    draft: str | None = None
    drafter: Literal["model", "ngram", "none"] = "ngram"
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    trust_remote_code: bool = False
    compile: bool = Field(False, description=(
        "torch.compile the decoder layers (Llama-family models): fuses the elementwise work between matmuls; "
        "the first passes compile (0.5-2 minutes on a small CPU). Off by default: on the CPU it was measured "
        "on (SmolLM2-135M fp32, batch 1 and 8, widths 1 and 9) compiled passes were 0-20% slower than eager."))

    @model_validator(mode="after")
    def _draft_present(self) -> ModelConfig:
        if self.drafter == "model" and not self.draft:
            raise _key_error("draft", "required when drafter is 'model'")
        return self


class GenerationConfig(_Section):
    max_new_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)
    seed: int = Field(0, ge=0, le=2**63 - 1)
    samples_per_prompt: int = Field(1, ge=1)
    stop: list[Annotated[str, Field(min_length=1)]] = Field(default_factory=list)
    chat_template: bool = True


class SpeculationConfig(_Section):
    k: Annotated[int | str, _either("adaptive", int, 0, "an integer")] = "adaptive"
    max_k: int = Field(8, ge=0, le=64)
    ngram_size: int = Field(3, ge=1, le=64)

    @model_validator(mode="after")
    def _k_within_max(self) -> SpeculationConfig:
        if isinstance(self.k, int) and self.k > self.max_k:
            raise _key_error("k", f"must be between 0 and max_k ({self.max_k})")
        return self


class ResourcesConfig(_Section):
    workers: Annotated[int | str, _either("auto", int, 1, "an integer")] = 1
    gpus_per_worker: Annotated[float | str, _either("auto", (int, float), 0, "a number")] = "auto"
    cpus_per_worker: float = Field(1, gt=0)
    memory: int | None = Field(None, gt=0)
    batch_size: int = Field(16, ge=1)


class ShardingConfig(_Section):
    rows_per_shard: int = Field(256, ge=1)


class RetriesConfig(_Section):
    max_attempts: int = Field(3, ge=1)


class JobConfig(_Section):
    """A whole job; build it with JobConfig.model_validate(dict_from_yaml)."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$")
    input: InputConfig
    output: OutputConfig
    model: ModelConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    retries: RetriesConfig = Field(default_factory=RetriesConfig)


def is_secret_key(key: str) -> bool:
    """Whether a key's value must never be shown (key, secret, token, password, ...)."""
    return bool(_SECRET_KEY.search(key))


def validation_message(err: ValidationError) -> str:
    """One message naming every bad key as a dotted path with its reason, and never a secret value."""
    lines = []
    for e in err.errors(include_url=False):
        loc = [str(part) for part in e["loc"]]
        if e["type"] == "bad_key":
            loc.append(e["ctx"]["key"])
        path = ".".join(loc) or "(config)"
        if e["type"] == "extra_forbidden":
            reason = "unknown key"
        elif e["type"] == "missing":
            reason = "required key is missing"
        else:
            reason = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            private = any(is_secret_key(p) or p == "storage_options" for p in loc)
            if isinstance(value, (str, int, float)) and not private:
                reason += f" (got {safe_url(value) if isinstance(value, str) else value!r})"
        lines.append(f"  {path}: {reason}")
    return f"invalid config ({len(lines)} problem{'s' if len(lines) != 1 else ''}):\n" + "\n".join(lines)


def redacted(config: JobConfig) -> dict[str, Any]:
    """The config as plain JSON-able data, safe for logs, _job.json and error messages."""
    return _redact(config.model_dump(mode="json"))


def _redact(value: Any, key: str = "") -> Any:
    if is_secret_key(key) and value is not None and not isinstance(value, (bool, int, float)):
        return REDACTED  # numbers under such keys (max_new_tokens) are settings, not secrets
    if isinstance(value, dict):
        return {k: _redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [_redact(v) for v in value]
    if isinstance(value, str):
        return safe_url(value)
    return value
