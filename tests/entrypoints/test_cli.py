"""The `deepinfer` CLI: help everywhere, generate, info, chat (REPL with history), bench."""

from __future__ import annotations

import io
import subprocess
import sys

import pytest

from deepinfer.entrypoints import cli


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "deepinfer.entrypoints.cli", *args], input=stdin,
                          capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("sub", [[], ["generate"], ["chat"], ["info"], ["bench"], ["serve"], ["bench", "serve"]])
def test_help_everywhere(sub, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*sub, "--help"])
    assert exit_.value.code == 0
    assert "usage: deepinfer" in capsys.readouterr().out


@pytest.mark.subprocess
def test_generate_streams_text(tiny_checkpoint):
    res = run_cli("generate", "hello", "--model", tiny_checkpoint("llama"), "--max-tokens", "5",
                  "--ignore-eos", "--raw", "--num-blocks", "16", "--max-model-len", "256")
    assert res.returncode == 0, res.stderr
    assert res.stdout.strip()


@pytest.mark.subprocess
def test_missing_model_is_a_clear_error(tmp_path):
    res = run_cli("generate", "hi", "--model", str(tmp_path / "missing"))
    assert res.returncode == 2 and "missing" in res.stderr and "Traceback" not in res.stderr


def test_info_reports_groups_and_capacity(tiny_checkpoint, capsys):
    assert cli.main(["info", "--model", tiny_checkpoint("llama"), "--kv-cache-memory", "1MiB",
                     "--block-size", "16"]) == 0
    out = capsys.readouterr().out
    # tiny llama: 2 layers, 2 kv heads x 16 dims -> rows of 64 fp32 = 256 B, 512 B per token
    assert "row K|V row, 64 elements = 256 B per row" in out
    assert "512 B per token; 128 blocks x 16 = 2,048 tokens" in out  # 1 MiB / (16 x 512 B)


def test_chat_repl_keeps_history(tiny_checkpoint):
    from deepinfer import LLM, SamplingParams
    from deepinfer.entrypoints.chat import run_chat

    llm = LLM(tiny_checkpoint("llama"), num_blocks=32, max_model_len=512)  # 32 blocks of 16 hold one request
    seen = []
    original = llm.apply_chat_template

    def recording_template(msgs, *args):
        seen.append([m["content"] for m in msgs])
        return original(msgs, *args)

    llm.apply_chat_template = recording_template
    out = io.StringIO()
    assert run_chat(llm, SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                    stdin=io.StringIO("first\nsecond\n/exit\n"), stdout=out) == 0
    assert seen[0] == ["first"] and seen[1][0] == "first" and seen[1][-1] == "second" and len(seen[1]) == 3
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks


@pytest.mark.slow
def test_ctrl_c_stops_an_answer_and_keeps_the_session(tiny_checkpoint):
    """Ctrl-C while an answer streams: the answer ends between steps with a marker, its request is
    aborted (every block free again), the partial reply stays in the history, the REPL goes on."""
    import signal

    from deepinfer import LLM, SamplingParams
    from deepinfer.entrypoints.chat import INTERRUPTED, run_chat

    llm = LLM(tiny_checkpoint("llama"), num_blocks=32, max_model_len=512)  # 32 blocks of 16 hold one request
    stream, seen = llm.stream, []

    def stream_then_ctrl_c(prompt, params):
        for i, out in enumerate(stream(prompt, params)):
            if len(seen) == 1 and i == 2:  # the first answer: a real SIGINT after its third output
                signal.raise_signal(signal.SIGINT)
            yield out

    original = llm.apply_chat_template
    llm.stream = stream_then_ctrl_c
    llm.apply_chat_template = lambda msgs, *a: seen.append([m["content"] for m in msgs]) or original(msgs, *a)
    out = io.StringIO()
    params = SamplingParams(max_tokens=50, temperature=0, ignore_eos=True)
    before = signal.signal(signal.SIGINT, signal.default_int_handler)  # a background shell may ignore SIGINT
    try:
        assert run_chat(llm, params, stdin=io.StringIO("first\nsecond\n/exit\n"), stdout=out) == 0
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # restored after each answer
    finally:
        signal.signal(signal.SIGINT, before)
    first_answer = out.getvalue().split("> ")[1]
    assert first_answer.endswith(INTERRUPTED + "\n")
    assert len(seen) == 2 and seen[1][1] == first_answer[: -len(INTERRUPTED) - 1]  # the partial reply kept
    assert out.getvalue().count(INTERRUPTED) == 1  # the second answer ran to its end
    kv = llm.engine.kv_manager
    assert kv.num_free_blocks == kv.num_total_blocks and not llm.engine.has_unfinished_requests()


def test_ctrl_c_at_the_prompt_quits_with_130():
    class Interrupted(io.StringIO):
        def readline(self, *args):
            raise KeyboardInterrupt

    from deepinfer.entrypoints.chat import run_chat

    assert run_chat(None, None, stdin=Interrupted(), stdout=io.StringIO()) == 130


def test_ctrl_c_in_any_command_is_one_line_and_status_130(monkeypatch, capsys):
    parser = cli.build_parser()
    args = parser.parse_args(["info"])

    def interrupted(_args):
        raise KeyboardInterrupt

    args.func = interrupted
    monkeypatch.setattr(parser, "parse_args", lambda argv=None: args)
    monkeypatch.setattr(cli, "build_parser", lambda: parser)
    assert cli.main(["info"]) == 130
    assert capsys.readouterr().err == "deepinfer: interrupted\n"


@pytest.mark.bench
def test_bench_runs_a_small_workload(tiny_checkpoint, tmp_path):
    import json

    out = tmp_path / "bench.json"
    assert cli.main(["bench", "--model", tiny_checkpoint("llama"), "--workload", "cpu32", "--num-requests", "3",
                     "--json", str(out), "--num-blocks", "256"]) == 0
    (result,) = json.loads(out.read_text())
    assert result["engine"] == "deepinfer" and result["output_tokens"] > 0
