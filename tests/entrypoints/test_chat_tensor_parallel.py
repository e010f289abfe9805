"""`deepinfer chat --tensor-parallel-size 2` (CPU, gloo) on a pseudo-terminal, as a person types:
greedy replies over two turns equal the one-rank chat's, and every way out (Ctrl-D; Ctrl-C to stop
an answer, then at the prompt; SIGTERM while an answer streams) ends the process promptly with no
rank left behind."""

from __future__ import annotations

import os
import signal
import sys

import pexpect
import pytest
from tp_processes import still_alive, workers

from deepinfer.entrypoints.chat import INTERRUPTED, LENGTH_LIMIT, QUIT_HINT

pytestmark = [pytest.mark.multirank, pytest.mark.subprocess]

TIMEOUT_S = 120  # per step: loading two ranks on a busy 2-core machine takes a while
# from a way out to the end of the process (the pty closes once every rank is gone): a hang guard, not a
# speed bound (a second or two on a quiet machine; a loaded one stretches the ranks' teardown)
STOP_S = 120
CTRL_C = "\x03"
TURNS = ["hello there", "how are you"]


def spawn_chat(path: str, tensor_parallel_size: int, max_model_len: int, max_tokens: int) -> pexpect.spawn:
    """Greedy `deepinfer chat` on a pseudo-terminal, at its first prompt. --ignore-eos makes every
    reply run to --max-tokens. SIGINT is reset in the child: a background shell starts processes
    with it ignored, and Ctrl-C must act."""
    args = ["-m", "deepinfer.entrypoints.cli", "chat", "--model", path, "--device", "cpu", "--max-model-len",
            str(max_model_len), "--temperature", "0", "--max-tokens", str(max_tokens), "--ignore-eos",
            "--history-file", "", "--tensor-parallel-size", str(tensor_parallel_size)]
    env = dict(os.environ, TERM="dumb")  # readline without colour or bracketed-paste escapes
    child = pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=TIMEOUT_S, dimensions=(40, 300),
                          preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    child.expect_exact("/help lists the commands")
    child.expect_exact("> ")
    return child


def turn(child: pexpect.spawn, line: str) -> str:
    """Type a line; return the reply printed before the next prompt (the echo left out)."""
    child.sendline(line)
    child.expect_exact("\r\n> ")
    echo, _, reply = child.before.partition("\r\n")
    assert echo == line, child.before
    return reply.replace("\r\n", "\n")


def test_two_ranks_answer_as_one_rank_does_and_ctrl_d_leaves_no_worker(tiny_checkpoint):
    path = tiny_checkpoint("llama")
    replies = {}
    for tp in (1, 2):
        child = spawn_chat(path, tp, max_model_len=64, max_tokens=8)
        try:
            ranks = workers(child.pid)
            replies[tp] = [turn(child, line) for line in TURNS]
            child.sendeof()  # Ctrl-D at the prompt
            child.expect(pexpect.EOF)
        finally:
            child.close(force=True)
        assert child.exitstatus == 0, (tp, child.before)
        assert len(ranks) == tp - 1, ranks  # tp 2: rank 1, and no other rank, beside the chat
        assert not still_alive(ranks), "a tensor-parallel worker outlived the chat"
    assert all(r.endswith(LENGTH_LIMIT) and len(r) > len(LENGTH_LIMIT) for r in replies[1]), replies
    assert replies[2] == replies[1]


@pytest.mark.parametrize("way_out", ["ctrl-c", "sigterm"])
def test_a_two_rank_chat_stopped_during_an_answer_ends_promptly_with_no_worker(tiny_checkpoint, way_out):
    """Ctrl-C reaches every rank (the terminal signals its whole foreground group): the answer stops,
    the ranks stay in step for the next turn, a second Ctrl-C at the prompt quits with 130. SIGTERM
    reaches the chat alone, mid-step: the worker must notice its parent is gone and exit."""
    child = spawn_chat(tiny_checkpoint("llama"), 2, max_model_len=256, max_tokens=200)
    try:
        ranks = workers(child.pid)
        child.sendline(TURNS[0])
        child.expect(rf"{TURNS[0]}\r\n.")  # the answer has begun; 200 tokens take seconds more
        if way_out == "ctrl-c":
            child.send(CTRL_C)
            child.expect_exact("\r\n> ")
            assert child.before.endswith(INTERRUPTED), child.before
            assert turn(child, TURNS[1]).endswith(LENGTH_LIMIT)
            child.send(CTRL_C)  # the first at the prompt says how to leave, the second leaves
            child.expect_exact(QUIT_HINT)
            child.send(CTRL_C)
        else:
            child.kill(signal.SIGTERM)
        child.expect(pexpect.EOF, timeout=STOP_S)  # must not hang: a TIMEOUT here fails the test
    finally:
        child.close(force=True)
    assert len(ranks) == 1, ranks
    if way_out == "ctrl-c":
        assert child.exitstatus == 130, child.before
    else:
        assert child.signalstatus == signal.SIGTERM or child.exitstatus == 128 + signal.SIGTERM
    assert not still_alive(ranks, within_s=5), "a tensor-parallel worker outlived the chat"
