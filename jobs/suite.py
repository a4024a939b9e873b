"""The workload suite: prompts in ten categories, each split once into a `tune` and a `report` half.

Why two halves: constants (controller thresholds, cost-model priors) may be fitted on `tune` only; the
README's claims come from `report`, so a controller is judged on prompts it was never tuned on. The
split is fixed in the files (a `split` field per row), not drawn at load time, so every run and
every reader sees the same halves.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SUITE_DIR = Path(__file__).resolve().parents[1] / "configs" / "data" / "suite"
SPLITS = ("tune", "report")
ROLES = ("system", "user", "assistant")


class SuiteError(ValueError):
    """A suite file or request cannot be used; the message names the file and line."""


@dataclass(frozen=True)
class SuitePrompt:
    """One suite row: a plain prompt, or a chat conversation ending with a user turn (multi_turn)."""

    id: str
    category: str
    split: str
    prompt: str | None
    messages: list[dict[str, str]] | None = field(hash=False)  # a list is unhashable; the id identifies the row

    def chat(self) -> list[dict[str, str]]:
        """The row as chat messages, what a worker feeds the tokenizer's chat template."""
        return self.messages if self.messages is not None else [{"role": "user", "content": self.prompt}]


def load_suite(split: str | None = None, categories: list[str] | None = None,
               root: str | Path = SUITE_DIR) -> dict[str, list[SuitePrompt]]:
    """category -> its prompts in file order, from `root/<category>.jsonl`; only `split` when given.

    Every file under root is read and checked (so ids are checked unique across the whole suite),
    then the requested categories are returned in the order asked (default: sorted by name).
    """
    if split is not None and split not in SPLITS:
        raise SuiteError(f"split must be one of {SPLITS} or None, not {split!r}")
    paths = sorted(Path(root).glob("*.jsonl"))
    if not paths:
        raise SuiteError(f"{root}: no suite files (*.jsonl) there")
    suite: dict[str, list[SuitePrompt]] = {}
    where_id: dict[str, str] = {}
    for path in paths:
        rows = suite[path.stem] = []
        for lineno, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
            if not line.strip():
                continue
            where = f"{path}:{lineno}"
            row = _parse_row(line, path.stem, where)
            if row.id in where_id:
                raise SuiteError(f"{where}: id {row.id!r} already used at {where_id[row.id]}")
            where_id[row.id] = where
            rows.append(row)
    wanted = sorted(suite) if categories is None else categories
    unknown = [c for c in wanted if c not in suite]
    if unknown:
        raise SuiteError(f"unknown categories {unknown}; {root} has {sorted(suite)}")
    return {c: [p for p in suite[c] if split is None or p.split == split] for c in wanted}


def interleave(suite: dict[str, list[SuitePrompt]]) -> list[SuitePrompt]:
    """Round-robin over the categories, in the dict's order: a "mixed" cell alternates categories
    (as a shared batch would) instead of running them back to back."""
    groups = list(suite.values())
    return [g[i] for i in range(max(map(len, groups), default=0)) for g in groups if i < len(g)]


def _parse_row(line: str, category: str, where: str) -> SuitePrompt:
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise SuiteError(f"{where}: not valid JSON ({exc.msg})") from None
    if not isinstance(row, dict):
        raise SuiteError(f"{where}: a row must be a JSON object, not {type(row).__name__}")
    source = [k for k in ("prompt", "messages") if k in row]
    extra = set(row) - {"id", "category", "split", "prompt", "messages"}
    missing = {"id", "category", "split"} - set(row)
    problems = [f"missing field(s) {sorted(missing)}"] if missing else []
    problems += [f"unknown field(s) {sorted(extra)}"] if extra else []
    if len(source) != 1:
        problems.append("exactly one of 'prompt' or 'messages' must be given")
    if not missing:
        if not isinstance(row["id"], str) or not row["id"].startswith(f"{category}-"):
            problems.append(f"id must be a string '{category}-NNN', got {row['id']!r}")
        if row["category"] != category:
            problems.append(f"category {row['category']!r} does not match the file name ({category!r})")
        if row["split"] not in SPLITS:
            problems.append(f"split must be one of {SPLITS}, got {row['split']!r}")
    if source == ["prompt"] and not (isinstance(row["prompt"], str) and row["prompt"].strip()):
        problems.append("prompt must be a non-empty string")
    if source == ["messages"] and (reason := _messages_problem(row["messages"])):
        problems.append(reason)
    if problems:
        raise SuiteError(f"{where}: " + "; ".join(problems))
    return SuitePrompt(row["id"], category, row["split"], row.get("prompt"), row.get("messages"))


def _messages_problem(messages: Any) -> str | None:
    """Why `messages` is not a conversation the target can answer, or None when it is."""
    if not isinstance(messages, list) or not messages:
        return "messages must be a non-empty list of {role, content}"
    for i, m in enumerate(messages):
        if not (isinstance(m, dict) and set(m) == {"role", "content"} and m["role"] in ROLES
                and isinstance(m["content"], str) and m["content"].strip()):
            return f"messages[{i}] must be {{role: one of {ROLES}, content: non-empty string}}"
    if messages[-1]["role"] != "user":
        return "the last message must be the user's (the model answers it)"
    return None
