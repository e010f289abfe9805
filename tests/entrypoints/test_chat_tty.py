"""`deepinfer chat` at a terminal: the real CLI and the default model (SmolLM2-135M) driven through a
pseudo-terminal, as a person types: readline recall, Ctrl-C, the commands, a context that overflows."""

from __future__ import annotations

import json
import os
import re
import signal
import sys

import pexpect
import pytest

pytestmark = [pytest.mark.slow, pytest.mark.subprocess]

MAX_MODEL_LEN, MAX_TOKENS = 64, 16  # with the model's own system prompt, the second turn outgrows the context
UP = "\x1b[A"
CTRL_C = "\x03"
TIMEOUT_S = 600  # per step; a loaded CPU may take minutes to load the model and answer


def spawn_chat(history_file) -> pexpect.spawn:
    """`deepinfer chat` on a pseudo-terminal. --ignore-eos makes every reply run to --max-tokens, so
    one can be interrupted midway. SIGINT is reset in the child: a background shell starts
    processes with it ignored, and Ctrl-C at the prompt must act."""
    args = ["-m", "deepinfer.entrypoints.cli", "chat", "--max-model-len", str(MAX_MODEL_LEN), "--max-tokens",
            str(MAX_TOKENS), "--ignore-eos", "--history-file", str(history_file)]
    env = dict(os.environ, TERM="dumb")  # readline without colour or bracketed-paste escapes
    return pexpect.spawn(sys.executable, args, env=env, encoding="utf-8", timeout=TIMEOUT_S, dimensions=(40, 300),
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def turn(child, line: str) -> str:
    """Type a line; return everything printed until the next prompt (the echo included)."""
    child.sendline(line)
    child.expect_exact("\r\n> ")
    return child.before


def test_chat_at_a_terminal(tmp_path):
    history, saved = tmp_path / "history", tmp_path / "chat.json"
    child = spawn_chat(history)
    try:
        child.expect_exact("/help lists the commands")
        child.expect_exact("> ")
        assert "/save FILE" in turn(child, "/help")
        first = turn(child, "Hello there")
        assert first.startswith("Hello there\r\n") and first.endswith(" [length limit]")  # streamed to --max-tokens
        assert len(first.split("\r\n")[1]) > len(" [length limit]")  # some text came before the marker

        child.send(UP)  # readline recalls the previous line; without it the terminal shows ^[[A
        child.expect_exact("Hello there")
        child.send("\r")
        child.expect_exact("\r\n> ")
        recalled = child.before
        assert "^[[A" not in recalled and "\x1b" not in recalled
        assert f"[dropped 2 oldest messages to fit the {MAX_MODEL_LEN}-token context]" in recalled
        assert recalled.endswith(" [length limit]")

        assert "system prompt set: Answer briefly." in turn(child, "/system Answer briefly.")
        stats = turn(child, "/stats")
        assert re.search(rf"last reply: {MAX_TOKENS} tokens in [\d.]+ s \([\d.]+ tok/s\); prompt \d+ tokens, "
                         r"\d+ cached\r\nsession: 2 replies, \d+ tokens", stats), stats

        child.sendline("Tell me a story")
        child.expect(r"story\r\n\S")  # the answer has begun
        child.send(CTRL_C)
        child.expect_exact("\r\n> ")
        assert child.before.endswith(" [interrupted]")
        assert turn(child, "And more").endswith(" [length limit]")  # the session goes on

        assert "[message not sent: " in turn(child, "word " * 80)
        assert f"to {saved}" in turn(child, f"/save {saved}")
        conversation = json.loads(saved.read_text())
        assert conversation[0] == {"role": "system", "content": "Answer briefly."}
        assert conversation[-2] == {"role": "user", "content": "And more"}
        assert conversation[-1]["role"] == "assistant" and conversation[-1]["content"]
        assert all(not m["content"].startswith("word word") for m in conversation)

        assert "history cleared" in turn(child, "/reset")
        assert "unknown command /bogus" in turn(child, "/bogus")
        child.send(CTRL_C)  # at the prompt, one Ctrl-C only says how to leave (it may be late for an answer)
        child.expect_exact("(Ctrl-C again, Ctrl-D or /exit to quit)")
        child.expect_exact("> ")
        child.send(CTRL_C)  # a second one in a row leaves with the shell's status for SIGINT
        child.expect(pexpect.EOF)
    finally:
        child.close(force=True)
    assert child.exitstatus == 130
    typed = history.read_text().splitlines()
    assert "Hello there" in typed and "/reset" in typed  # kept for the next session's Up-arrow
