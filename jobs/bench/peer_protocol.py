"""The protocol between the bench and a peer engine's runner (peer_llama.py, peer_vllm.py), which runs in the
peer's own virtualenv: standard library only, so that it imports there without this project installed.

The bench starts the runner once per peer (vLLM: once per batch size) and keeps it alive across a cell's
repeats, so that model load stays out of every timing. Requests and replies are one JSON object a line:

  {"op": "load", "model": FOLDER, "dtype": "float32", "threads": 2, "n_ctx": 2048, "batch_size": 4}
      -> {"ok": true, "engine": "llama-cpp-python 0.3.36", ...}
  {"op": "generate", "prompts": [[ids], ...], "max_new_tokens": 24, "eos": [2], "batch_size": 4,
   "prompt_lookup": 0}
      -> {"outputs": [[ids], ...], "wall_s": 0.8, "passes": 31 | null, "row_passes": [[n], ...] | null}
  {"op": "exit"} -> {"ok": true}
  any failure   -> {"error": "...", "traceback": "..."}

Prompts are token ids, decoded greedily; each output is cut at and including its first EOS; wall_s is the
generation alone, timed here around the engine's call; passes are target passes when the engine tells them.
The runner's own stdout is the protocol's: everything the engine prints goes to stderr instead.
"""
from __future__ import annotations

import json
import os
import sys
import time
import traceback
from collections.abc import Callable
from typing import Any, Protocol


def cut_at_eos(tokens: list[int], eos: list[int]) -> list[int]:
    """A completion up to and including its first EOS (engines may pad or run on after it)."""
    for i, token in enumerate(tokens):
        if token in eos:
            return tokens[: i + 1]
    return tokens


class Engine(Protocol):
    info: dict[str, Any]

    def generate(self, request: dict) -> tuple[list[list[int]], int | None, list[int] | None]:
        """(completions, target passes or None, per-row passes or None) for a generate request."""


def _answer(engine: Engine | None, request: dict, load: Callable[[dict], Engine]) -> tuple[Engine | None, dict]:
    op = request.get("op")
    if op == "load":
        engine = load(request)
        return engine, {"ok": True, **engine.info}
    if op == "generate":
        if engine is None:
            raise RuntimeError("generate before load")
        started = time.perf_counter()
        outputs, passes, row_passes = engine.generate(request)
        wall = time.perf_counter() - started
        eos = [int(t) for t in request["eos"]]
        return engine, {"outputs": [cut_at_eos([int(t) for t in o], eos)[: request["max_new_tokens"]] for o in outputs],
                        "wall_s": wall, "passes": passes, "row_passes": row_passes}
    raise ValueError(f"unknown op {op!r}")


def serve(load: Callable[[dict], Engine]) -> None:
    """Answer requests from stdin until `exit` or end of input; `load` builds the engine from a load request."""
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)            # what the engine (or a library under it) prints must not corrupt the replies
    sys.stdout = sys.stderr
    engine: Engine | None = None
    for line in sys.stdin:
        if not line.strip():
            continue
        request = json.loads(line)
        if request.get("op") == "exit":
            protocol.write(json.dumps({"ok": True}) + "\n")
            break
        try:
            engine, reply = _answer(engine, request, load)
        except Exception as exc:  # noqa: BLE001 - every failure goes back to the bench, which reports it
            reply = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc()}
        protocol.write(json.dumps(reply) + "\n")
    protocol.close()
