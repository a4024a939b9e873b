"""A stand-in for a peer engine's runner (jobs/bench/peer_llama.py, peer_vllm.py) in the tests: a real subprocess
speaking the real protocol (jobs/bench/peer_protocol.py) with known answers and known timing.

Run as `fake_peer.py RUNNER` (the runner the bench asked for, named back in its answers). Every row's
completion is 100, 101, ... (max_new_tokens of them), with the EOS id at position `row index + 1` for rows whose
first prompt token is odd; each generate call sleeps FAKE_PEER_DELAY seconds (default 0.05). FAKE_PEER_FAIL=load
fails the load, =generate every generate, =die exits in the middle of the first generate.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "jobs" / "bench"))
from peer_protocol import serve  # noqa: E402

FAIL = os.environ.get("FAKE_PEER_FAIL", "")
DELAY = float(os.environ.get("FAKE_PEER_DELAY", "0.05"))


class FakeEngine:
    def __init__(self, request: dict):
        print("engine chatter on stdout must not reach the bench")   # serve() sends this to stderr
        if FAIL == "load":
            raise RuntimeError("fake load failure")
        self.info = {"engine": f"fake {Path(sys.argv[1]).stem} pid {os.getpid()}", "load": request}

    def generate(self, request: dict) -> tuple[list[list[int]], int, list[int]]:
        if FAIL == "generate":
            raise RuntimeError("fake generate failure")
        if FAIL == "die":
            os._exit(3)
        time.sleep(DELAY)
        eos, n = request["eos"][0], request["max_new_tokens"]
        outputs = []
        for i, prompt in enumerate(request["prompts"]):
            row = [100 + j for j in range(n + 3)]           # runs on past max_new_tokens: serve() cuts
            if prompt[0] % 2:
                row[i + 1] = eos                             # and past EOS: serve() cuts after it
            outputs.append(row)
        per_row = [min(len(o), n) for o in outputs]
        return outputs, sum(per_row), per_row


if __name__ == "__main__":
    serve(FakeEngine)
