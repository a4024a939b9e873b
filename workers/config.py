"""The job config: one pydantic model per YAML section.

It lives in workers/ because both sides read it: the driver validates it before anything starts,
and each worker reads its rows and writes its output from the same object. Every model forbids
unknown keys and runs in strict mode, so a typo or a wrong type is reported instead of guessed.
"""

from __future__ import annotations

import difflib
import re
import string
from collections.abc import Callable
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


DRAFTER_NAMES = ("model", "mtp", "ngram", "none", "suffix")  # the registry's names (workers/registry.py)


def _drafter_names(value: Any) -> str | list[str]:
    """A drafter name, or a list of them to compose (the first with a proposal drafts each row)."""
    names = value if isinstance(value, list) else [value]
    if not names or any(not isinstance(n, str) or n not in DRAFTER_NAMES for n in names):
        raise ValueError(f"must be one of {', '.join(DRAFTER_NAMES)}, or a non-empty list of them")
    if isinstance(value, list) and (len(set(names)) != len(names) or "none" in names):
        raise ValueError("a list names each drafter once and leaves out 'none'")
    return value


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
    path: str = Field(description="a file, folder (recursive) or glob; `.parquet` or `.jsonl`/`.json` by extension")
    prompt_column: str | None = Field("prompt", description="plain-text prompt column")
    messages_column: str | None = Field(None, description="instead: a list of `{role, content}` chat messages")
    id_column: str | None = Field("id", description="stable row id; `null` derives `file:row` (Parquet) or `file@byte` (JSONL)")
    template: str | None = Field(None, description='instead: a prompt built from row columns, e.g. `"Summarize:\\n{text}"`')
    storage_options: dict[str, Any] = Field(
        default_factory=dict,
        description="passed to fsspec (`endpoint_url`, `key`, `secret`, `anon`, …); also used for models in object storage")
    overlong: Literal["truncate", "error"] = Field(
        "truncate", description="prompts longer than the context: `truncate` (keep the end) or `error` (error row)")
    on_bad_file: Literal["fail", "skip"] = Field(
        "fail", description="corrupt / non-Parquet file: `fail` (name it) or `skip` (listed in the summary)")
    duplicate_ids: Literal["error", "suffix"] = Field(
        "error", description="a repeated id within a shard: `error` row, or `suffix` (`id#1`)")
    limit: int | None = Field(None, ge=1, description=(
        "run only the input's first N rows (a slice of the job; `--limit N` sets it): a later run without it on "
        "the same output resumes the slice's shards and runs the rest"))

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
    path: str = Field(description="where the output goes (see Output)")
    storage_options: dict[str, Any] = Field(default_factory=dict, description="fsspec options for the output")
    keep_columns: list[str] = Field(default_factory=list, description="input columns copied into every output row")
    max_failed_rows: int = Field(
        0, ge=0, description="more failed rows than this: exit code 3 (the output and `_SUCCESS` are written all the same)")

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
    target: str = Field(description="local folder, `s3://` folder, `.gguf` file, or `demo:smollm2`")
    draft: str | None = Field(None, description="draft model sharing the target's tokenizer")
    drafter: Annotated[str | list[str], PlainValidator(_drafter_names)] = Field("ngram", description=(
        "`none`, `ngram` (prompt lookup in the row), `suffix` (an index over everything this worker has read and "
        "written in the job), `model` (a small draft model at model.draft), `mtp` (an MTP head made by `specbatch distill`, at model.draft), or a list such as `[suffix, ngram]`: "
        "per row, the first drafter in the list with a confident proposal drafts"))
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = Field(
        "auto", description=(
        "`auto` (the checkpoint's dtype where the device computes in it natively, else fp32; see Dtypes below), "
        "`float32`, `bfloat16`, `float16`"))
    trust_remote_code: bool = Field(False, description="passed to transformers")
    compile: bool = Field(False, description=(
        "torch.compile the decoder layers (Llama-family models): fuses the elementwise work between matmuls; "
        "the first passes compile (0.5-2 minutes on a small CPU). Off by default: on the CPU it was measured "
        "on (SmolLM2-135M fp32, batch 1 and 8, widths 1 and 9) compiled passes were 0-20% slower than eager."))

    step: Literal["auto", "captured", "eager"] = Field("auto", description=(
        "how a decode step runs: `captured` replays one static-shape step per (rows, width) bucket as a CUDA "
        "graph (one launch per pass instead of ~40 kernels a layer); `eager` runs the layers op by op; `auto` "
        "captures on a GPU and runs eagerly on a CPU, where a static step only adds padding"))

    @model_validator(mode="after")
    def _draft_present(self) -> ModelConfig:
        needs = [name for name in ("model", "mtp") if name in self.drafters]
        if len(needs) > 1:
            raise _key_error("drafter", "model.draft holds one set of weights: name `model` or `mtp`, not both")
        if needs and not self.draft:
            raise _key_error("draft", f"required when drafter is '{needs[0]}'")
        return self

    @property
    def drafters(self) -> list[str]:
        return self.drafter if isinstance(self.drafter, list) else [self.drafter]


class GenerationConfig(_Section):
    max_new_tokens: int = Field(128, ge=1, description="per completion")
    temperature: float = Field(0.0, ge=0, description="`0` = greedy")
    top_p: float = Field(1.0, gt=0, le=1, description="nucleus sampling; applied to target and draft alike")
    top_k: int = Field(0, ge=0, description="`0` = off; applied to target and draft alike")
    seed: int = Field(0, ge=0, le=2**63 - 1, description="each row's seed derives from it, the row id and the sample index")
    samples_per_prompt: int = Field(1, ge=1, description=(
        "completions per input row (`sample_index` 0..n-1); more than 1 needs `temperature` above 0 (and `top_k` "
        "not 1): greedy samples are identical, and `run` and `submit` warn"))
    stop: list[Annotated[str, Field(min_length=1)]] = Field(
        default_factory=list, description="stop strings besides the model's EOS (the completion ends before them)")
    chat_template: bool = Field(True, description="wrap plain prompts in the tokenizer's chat template")
    logprobs: int | None = Field(None, ge=0, le=20, description=(
        "log-probabilities in the output: the chosen token's at every position, plus the N most likely "
        "tokens' (0: the chosen token's only; null: none). From the target's own logits, before "
        "temperature and top-k/top-p, so speculation never changes them"))


class SpeculationConfig(_Section):
    k: Annotated[int | str, _either("adaptive", int, 0, "an integer")] = Field(
        "adaptive", description="`adaptive` or a fixed int (`0` = no speculation)")
    max_k: int = Field(8, ge=0, le=64, description="largest draft length")
    ngram_size: int = Field(3, ge=1, le=64, description="longest n-gram the prompt-lookup drafter matches")
    suffix_max_tokens: int = Field(32768, ge=0, description=(
        "tokens the suffix drafter keeps indexed per worker (prompts and completions, oldest finished rows "
        "evicted first); about 2 KiB of memory per token"))
    sampling: Literal["invariant", "rejection"] = Field("invariant", description=(
        "how sampled drafts are verified: `invariant` (target and draft share per-token noise, Gumbel-max: the "
        "output depends on the target and the seed only, whatever the drafter) or `rejection` (Leviathan et al.: "
        "accepts more of a draft model's tokens, but the output then depends on the draft model); either keeps "
        "the target's distribution exactly"))
    learn: Literal["none", "mtp"] = Field("none", description=(
        "`mtp`: the job distils an MTP draft head from its own committed completions once "
        "`learn_after_rows` are written, saves it under OUTPUT/drafters/, and every worker then drafts with "
        "the copy drafters first and the head after them; a resumed job starts with the saved head"))
    learn_after_rows: int = Field(256, ge=8, description="output rows committed before the head is distilled")
    learn_minutes: float = Field(5.0, gt=0, description=(
        "wall-clock budget of the distillation (it runs beside generation, as a Ray task)"))
    learn_min_speedup: float = Field(1.0, ge=0, description=(
        "workers switch to the learnt head only when its expected speed-up over plain decoding at the job's "
        "batch size (held-out acceptance and measured draft and verify costs; in the head's report) exceeds "
        "this; 0 switches whatever it is"))

    @model_validator(mode="after")
    def _k_within_max(self) -> SpeculationConfig:
        if isinstance(self.k, int) and self.k > self.max_k:
            raise _key_error("k", f"must be between 0 and max_k ({self.max_k})")
        return self


class ResourcesConfig(_Section):
    workers: Annotated[int | str, _either("auto", int, 1, "an integer")] = Field(
        1, description="worker actors, or `auto` (one per GPU)")
    gpus_per_worker: Annotated[float | str, _either("auto", (int, float), 0, "a number")] = Field(
        "auto", description="`auto` = 1 when the cluster has GPUs, else CPU")
    cpus_per_worker: float = Field(1, gt=0, description="Ray CPUs per actor; also the actor's torch thread count")
    memory: int | None = Field(None, gt=0, description="optional bytes per actor")
    batch_size: int = Field(16, ge=1, description="rows generated together per worker")
    price_per_worker_hour: float | None = Field(None, ge=0, description=(
        "optional price of one worker for an hour, in any currency: `specbatch plan` then predicts the job's cost"))


class ShardingConfig(_Section):
    rows_per_shard: int = Field(256, ge=1, description=(
        "input rows per shard, the unit of scheduling, retry and resume; each input row gives "
        "`samples_per_prompt` output rows (JSONL: estimated from the first 64 KiB)"))


class RetriesConfig(_Section):
    max_attempts: int = Field(3, ge=1, description="attempts per shard (worker death, storage failure)")


class JobConfig(_Section):
    """A whole job; build it with JobConfig.model_validate(dict_from_yaml)."""

    name: str = Field("demo", pattern=r"^[A-Za-z0-9_.-]+$", description="job name (`[A-Za-z0-9_.-]+`)")
    input: InputConfig
    output: OutputConfig
    model: ModelConfig
    generation: GenerationConfig = Field(default_factory=GenerationConfig)
    speculation: SpeculationConfig = Field(default_factory=SpeculationConfig)
    resources: ResourcesConfig = Field(default_factory=ResourcesConfig)
    sharding: ShardingConfig = Field(default_factory=ShardingConfig)
    retries: RetriesConfig = Field(default_factory=RetriesConfig)

    @model_validator(mode="after")
    def _learn_from_copy_drafters(self) -> JobConfig:
        models = [name for name in self.model.drafters if name in ("model", "mtp")]
        if self.speculation.learn != "none" and models:
            raise _key_error("speculation.learn", f"a learning job starts from copy drafters (ngram, suffix, none) and adds the "
                                      f"head it learns; model.drafter names '{models[0]}'")
        return self


def config_warnings(config: JobConfig) -> list[str]:
    """What a valid config asks for that its author rarely means: said before the job starts, never refused."""
    g = config.generation
    if g.samples_per_prompt > 1 and (g.temperature == 0 or g.top_k == 1):
        why = "generation.temperature is 0 (greedy decoding)" if g.temperature == 0 else "generation.top_k is 1"
        return [f"generation.samples_per_prompt is {g.samples_per_prompt} but {why}: every sample of a prompt "
                "will be the same completion; set generation.temperature above 0 for different samples"]
    return []


def is_secret(key: str, value: Any) -> bool:
    """Whether a value must never be shown: text (or a section) under a key that names a secret (key, secret,
    token, password, ...). Numbers and flags under such names (max_new_tokens) are settings."""
    return bool(_SECRET_KEY.search(key)) and value is not None and not isinstance(value, (bool, int, float))


def validation_problems(err: ValidationError) -> list[tuple[str, str]]:
    """(dotted key, reason) for every problem, with a "did you mean" for unknown keys and never a secret value."""
    problems = []
    for e in err.errors(include_url=False):
        loc = [str(part) for part in e["loc"]]
        if e["type"] == "bad_key":
            loc.append(e["ctx"]["key"])
        if e["type"] == "extra_forbidden":
            reason = "unknown key" + _did_you_mean(loc)
        elif e["type"] == "missing":
            reason = "required key is missing"
        else:
            reason = e["msg"].removeprefix("Value error, ")
            value = e.get("input")
            private = "storage_options" in loc or any(is_secret(p, value) for p in loc)
            if isinstance(value, (str, int, float)) and not private:
                reason += f" (got {safe_url(value) if isinstance(value, str) else value!r})"
        problems.append((".".join(loc) or "(config)", reason))
    return problems


def validation_message(err: ValidationError, source: Callable[[str], str] = lambda key: "") -> str:
    """One message naming every bad key as a dotted path with its reason; source(key) says where it was set."""
    lines = [f"  {key}{source(key)}: {reason}" for key, reason in validation_problems(err)]
    return f"invalid config ({len(lines)} problem{'s' if len(lines) != 1 else ''}):\n" + "\n".join(lines)


def _sections() -> dict[str, type[BaseModel]]:
    return {name: field.annotation for name, field in JobConfig.model_fields.items()
            if isinstance(field.annotation, type) and issubclass(field.annotation, BaseModel)}


def _did_you_mean(loc: list[str]) -> str:
    """A suggestion for an unknown key: the same name in another section, else a close spelling in its own."""
    *parents, key = loc
    sections = _sections()
    if len(parents) == 1 and parents[0] in sections:
        known = list(sections[parents[0]].model_fields)
        elsewhere = [f"{name}.{key}" for name, model in sections.items() if key in model.model_fields]
    elif not parents:
        known, elsewhere = list(JobConfig.model_fields), []
    else:
        return ""
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
    guess = elsewhere[0] if elsewhere else ".".join([*parents, close[0]]) if close else None
    return f"; did you mean {guess}?" if guess else ""


def redacted(config: JobConfig) -> dict[str, Any]:
    """The config as plain JSON-able data, safe for logs, _job.json and error messages."""
    return redact(config.model_dump(mode="json"))


def redact(value: Any, key: str = "") -> Any:
    """Plain data with every secret replaced by *** and passwords taken out of URLs."""
    if is_secret(key, value):
        return REDACTED
    if isinstance(value, dict):
        return {k: redact(v, str(k)) for k, v in value.items()}
    if isinstance(value, list):
        return [redact(v) for v in value]
    if isinstance(value, str):
        return safe_url(value)
    return value
