"""llama.cpp as a bench peer: run with the python of the llama-cpp virtualenv (`make bench-peers`), never the
project's. Speaks peer_protocol on stdin/stdout.

The target's safetensors folder is converted once with the converter vendored in the llama-cpp-python sdist
(kept in the venv's src/) into a GGUF of the bench's dtype (float32: F32), cached in the venv's gguf/ folder.
At batch 1 a row decodes through `Llama.generate`, greedily (temperature 0, top_k 1, no penalties), from the
prompt's token ids, from an empty KV cache. Prompt lookup (batch 1) is `LlamaPromptLookupDecoding(num_pred_tokens=N)`
as `draft_model`, on a second `Llama` over the same (memory-mapped) file: a draft model makes llama-cpp-python
keep every position's logits, which plain decoding should not pay for. Passes are `Llama.eval` calls.

At batch > 1 (llama-cpp-python's `Llama` holds one sequence) the rows decode together, as llama.cpp's own
batched examples do: one context over the same model with a KV stream per row (n_seq_max = batch), one
`llama_decode` a step over every live row's next token, the greedy token the argmax of its logits, and a waiting
prompt admitted (its whole prompt in that step's batch) as soon as a row finishes: `batch` rows stay live, as
this generator keeps them. Passes are `llama_decode` calls.
"""
from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import tempfile
from collections import deque
from pathlib import Path
from typing import Any

from peer_protocol import serve

OUTTYPES = {"float32": "f32", "bfloat16": "bf16", "float16": "f16"}


def converter() -> Path:
    found = sorted((Path(sys.prefix) / "src").glob("llama_cpp_python-*/vendor/llama.cpp/convert_hf_to_gguf.py"))
    if not found:
        raise FileNotFoundError(f"no llama-cpp-python sdist under {sys.prefix}/src: run `make bench-peers` again")
    return found[-1]


def gguf_for(folder: Path, dtype: str) -> Path:
    """The folder's GGUF in `dtype`, converted once; keyed by the folder's path and its files' sizes and times."""
    files = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in folder.iterdir() if p.is_file())
    key = hashlib.sha256(json.dumps([str(folder.resolve()), files]).encode()).hexdigest()[:16]
    out = Path(sys.prefix) / "gguf" / f"{folder.name}-{key}-{OUTTYPES[dtype]}.gguf"
    if not out.exists():
        out.parent.mkdir(exist_ok=True)
        tmp = out.with_name(out.name + f".tmp{os.getpid()}")
        print(f"peer_llama: converting {folder} to {out}", file=sys.stderr, flush=True)
        with tempfile.TemporaryDirectory() as scratch:
            subprocess.run([sys.executable, str(converter()), str(_readable(folder, Path(scratch))), "--outtype",
                            OUTTYPES[dtype], "--outfile", str(tmp)], check=True, stdout=sys.stderr)
        tmp.rename(out)
    return out


def _readable(folder: Path, scratch: Path) -> Path:
    """The folder as the converter's transformers (4.x, as its requirements pin) reads it: a tokenizer saved by
    transformers 5 names the class `TokenizersBackend`, which 4.x calls PreTrainedTokenizerFast. The other
    files are linked, not copied."""
    config = folder / "tokenizer_config.json"
    data = json.loads(config.read_text()) if config.exists() else {}
    if data.get("tokenizer_class") != "TokenizersBackend":
        return folder
    staged = scratch / folder.name
    staged.mkdir()
    for path in folder.iterdir():
        if path.name != config.name:
            (staged / path.name).symlink_to(path.resolve())
    (staged / config.name).write_text(json.dumps({**data, "tokenizer_class": "PreTrainedTokenizerFast"}))
    return staged


class LlamaEngine:
    def __init__(self, request: dict):
        import llama_cpp

        self.path = str(gguf_for(Path(request["model"]), request.get("dtype", "float32")))
        self.threads, self.n_ctx = int(request["threads"]), int(request["n_ctx"])
        self.by_lookup: dict[int, tuple[Any, list[int]]] = {}
        self.batched: dict[int, tuple[Any, Any, int]] = {}
        self.info = {"engine": f"llama-cpp-python {llama_cpp.__version__}", "gguf": self.path}
        self._llama(0)   # the load is not part of any timing

    def _llama(self, lookup: int) -> tuple[Any, list[int]]:
        if lookup not in self.by_lookup:
            from llama_cpp import Llama
            from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

            draft = LlamaPromptLookupDecoding(num_pred_tokens=lookup) if lookup else None
            llm = Llama(model_path=self.path, n_ctx=self.n_ctx, n_threads=self.threads, n_threads_batch=self.threads,
                        draft_model=draft, seed=0, verbose=False)
            passes, evaluate = [0], llm.eval

            def counted(tokens: Any) -> None:
                passes[0] += 1
                evaluate(tokens)

            llm.eval = counted
            self.by_lookup[lookup] = (llm, passes)
        return self.by_lookup[lookup]

    def generate(self, request: dict) -> tuple[list[list[int]], int, list[int]]:
        lookup = int(request.get("prompt_lookup") or 0)
        if int(request["batch_size"]) > 1 and not lookup:
            return self._generate_batched(request)
        llm, passes = self._llama(lookup)
        eos, limit = {int(t) for t in request["eos"]}, int(request["max_new_tokens"])
        outputs, row_passes = [], []
        for prompt in request["prompts"]:
            llm.reset()   # no prefix reuse from the previous row or repeat: every row prefills its whole prompt
            before, out = passes[0], []
            for token in llm.generate([int(t) for t in prompt], top_k=1, top_p=1.0, min_p=0.0, temp=0.0,
                                      repeat_penalty=1.0, reset=True):
                out.append(int(token))
                if token in eos or len(out) >= limit:
                    break
            outputs.append(out)
            row_passes.append(passes[0] - before)
        return outputs, sum(row_passes), row_passes

    def _batched(self, rows: int) -> tuple[Any, Any, int]:
        """A context with a KV stream for each of `rows` sequences over the plain Llama's model, its settings
        (threads, KV cache types, attention) copied from that Llama's context; one such context at a time."""
        if rows not in self.batched:
            import llama_cpp
            from llama_cpp import _internals

            for ctx, batch, _ in self.batched.values():
                batch.close()
                ctx.close()
            self.batched.clear()
            llm = self._llama(0)[0]
            n_batch = self.n_ctx + rows   # one whole prompt and every other row's next token fit one step
            params = llama_cpp.llama_context_params.from_buffer_copy(llm.context_params)
            params.n_ctx, params.n_seq_max = self.n_ctx * rows, rows
            params.n_batch, params.n_ubatch = n_batch, min(n_batch, llm.context_params.n_ubatch)
            ctx = _internals.LlamaContext(model=llm._model, params=params, verbose=False)
            batch = _internals.LlamaBatch(n_tokens=n_batch, embd=0, n_seq_max=1, verbose=False)
            self.batched[rows] = (ctx, batch, n_batch)
        return self.batched[rows]

    def _generate_batched(self, request: dict) -> tuple[list[list[int]], int, list[int]]:
        import llama_cpp
        import numpy as np

        rows = int(request["batch_size"])
        ctx, batch, n_batch = self._batched(rows)
        n_vocab = self._llama(0)[0].n_vocab()
        prompts = [[int(t) for t in p] for p in request["prompts"]]
        eos, limit = {int(t) for t in request["eos"]}, int(request["max_new_tokens"])
        outputs: list[list[int]] = [[] for _ in prompts]
        row_passes, passes = [0] * len(prompts), 0
        waiting, free = deque(range(len(prompts))), list(range(rows))[::-1]
        live: dict[int, list[int]] = {}   # sequence -> [row, position of its next token, its next token]
        b = batch.batch
        ctx.kv_cache_clear()

        def add(token: int, pos: int, seq: int, logits: bool) -> int:
            j = b.n_tokens
            b.token[j], b.pos[j], b.n_seq_id[j], b.logits[j] = token, pos, 1, logits
            b.seq_id[j][0] = seq
            b.n_tokens = j + 1
            return j

        while waiting or live:
            b.n_tokens = 0
            logits_at: dict[int, int] = {}   # sequence -> index of its logits in this step
            for seq, state in live.items():
                logits_at[seq] = add(state[2], state[1], seq, True)
                state[1] += 1
            while waiting and free and b.n_tokens + len(prompts[waiting[0]]) <= n_batch:
                row, seq = waiting.popleft(), free.pop()
                llama_cpp.llama_memory_seq_rm(ctx.memory, seq, -1, -1)
                for i, token in enumerate(prompts[row]):
                    logits_at[seq] = add(token, i, seq, i == len(prompts[row]) - 1)
                live[seq] = [row, len(prompts[row]), -1]
            if not logits_at:
                raise ValueError(f"a prompt of {len(prompts[waiting[0]])} tokens does not fit a batch of {n_batch}")
            ctx.decode(batch)
            passes += 1
            for seq, j in logits_at.items():
                state = live[seq]
                token = int(np.ctypeslib.as_array(ctx.get_logits_ith(j), shape=(n_vocab,)).argmax())
                out = outputs[state[0]]
                out.append(token)
                row_passes[state[0]] += 1
                if token in eos or len(out) >= limit:
                    del live[seq]
                    free.append(seq)
                else:
                    state[2] = token
        return outputs, passes, row_passes


if __name__ == "__main__":
    serve(LlamaEngine)
