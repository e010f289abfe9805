"""`deepinfer serve --tensor-parallel-size 2` (CPU, gloo): answers as one rank does, and a rank
that dies takes the server down with a message naming it, leaving no worker behind."""

from __future__ import annotations

import dataclasses
import os
import signal

import httpx
import pytest
from live_server import LiveServer
from tp_processes import still_alive, workers

from deepinfer import LLM

pytestmark = [pytest.mark.live_server, pytest.mark.multirank]

PROMPT = [5, 17, 99, 3, 250, 41, 8, 77]


def test_two_ranks_serve_one_ranks_answer_and_a_dead_rank_stops_the_server(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    with LLM(path, device="cpu", max_model_len=64) as llm:
        # the server's unset fields (repetition_penalty) take the model's defaults, as these do
        params = dataclasses.replace(llm.get_default_sampling_params(), max_tokens=8, temperature=0.0, ignore_eos=True)
        expected = llm.generate([{"prompt_token_ids": PROMPT}], params, use_tqdm=False)
    expected_text = expected[0].outputs[0].text
    body = {"prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    with LiveServer("--model", path, "--device", "cpu", "--max-model-len", "64", "--tensor-parallel-size", "2") as s:
        answer = httpx.post(f"{s.url}/v1/completions", json=body, timeout=60).json()
        assert answer["choices"][0]["text"] == expected_text
        ranks = workers(s.proc.pid)
        assert len(ranks) == 1, ranks  # rank 1 (and no other rank) runs beside the server
        os.kill(ranks[0], signal.SIGKILL)
        try:
            httpx.post(f"{s.url}/v1/completions", json=body, timeout=30)
        except httpx.HTTPError:
            pass  # the server may go down before it answers
        s.proc.wait(30)
        log = s.log_tail()
        assert s.proc.returncode != 0, log
        assert "rank 1" in log, log
    assert not still_alive(ranks, within_s=10)
