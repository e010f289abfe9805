"""`deepinfer serve --tensor-parallel-size 2` (CPU, gloo): answers as one rank does, and a rank
that dies takes the server down with a message naming it, leaving no worker behind."""

from __future__ import annotations

import os
import signal
import time

import httpx
from live_server import LiveServer

from deepinfer import LLM, SamplingParams

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77]


def _children(pid: int) -> list[int]:
    """The processes `pid` started (Linux /proc)."""
    found = []
    for task in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{task}/children") as f:
            found += [int(c) for c in f.read().split()]
    return found


def _is_worker(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return b"spawn_main" in f.read()  # not the resource tracker
    except OSError:
        return False


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def test_two_ranks_serve_one_ranks_answer_and_a_dead_rank_stops_the_server(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with LLM(path, device="cpu", max_model_len=64) as llm:
        expected = llm.generate([{"prompt_token_ids": PROMPT}], SamplingParams(max_tokens=8, temperature=0.0,
                                                                              ignore_eos=True), use_tqdm=False)
    expected_text = expected[0].outputs[0].text
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with LiveServer("--model", path, "--device", "cpu", "--max-model-len", "64", "--tensor-parallel-size", "2") as s:
        answer = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == expected_text
        workers = [p for p in _children(s.proc.pid) if _is_worker(p)]
        assert len(workers) == 1, workers  # rank 1 (and no other rank) runs beside the server
        os.kill(workers[0], signal.SIGKILL)
        try:
            httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        except httpx.HTTPError:
            pass  # the server may go down before it answers
        s.proc.wait(30)
        log = s.log_tail()
        assert s.proc.returncode != 0, log
        assert "rank 1" in log, log
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in workers) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in workers)
