"""`deepinfer generate -` reads the prompt from standard input: the same output as the prompt
given as an argument; an empty standard input is one line and status 2."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from deepinfer.entrypoints.cli import read_prompt


def _generate(prompt_arg: str, model: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", "generate", prompt_arg,
                           "--model", model, "--max-tokens", "6", "--ignore-eos", "--raw", "--num-blocks", "16",
                           "--max-model-len", "256"],
                          input=stdin, capture_output=True, text=True, timeout=300)


@pytest.mark.subprocess
def test_dash_reads_the_prompt_from_stdin(tiny_checkpoint):
    model = tiny_checkpoint("llama")
    piped = _generate("-", model, stdin="Once upon a time\n")
    direct = _generate("Once upon a time", model)
    assert piped.returncode == 0 and direct.returncode == 0, piped.stderr + direct.stderr
    assert piped.stdout.strip() and piped.stdout == direct.stdout


@pytest.mark.subprocess
def test_empty_stdin_is_one_line_and_status_2(tiny_checkpoint):
    res = _generate("-", tiny_checkpoint("llama"), stdin="  \n")
    assert res.returncode == 2 and res.stderr.strip().count("\n") == 0
    assert "standard input was empty" in res.stderr


@pytest.mark.parametrize("stdin, expected", [("one line\n", "one line"), ("two\nlines", "two\nlines"),
                                             ("kept  \n\n", "kept  \n")])
def test_read_prompt_drops_one_trailing_newline(stdin, expected):
    assert read_prompt("-", io.StringIO(stdin)) == expected
    assert read_prompt("not a dash", io.StringIO(stdin)) == "not a dash"
