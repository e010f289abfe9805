"""`deepinfer ... --help` shows defaults; a bad or unknown flag prints that subcommand's short usage."""

from __future__ import annotations

import pytest

from deepinfer.entrypoints import cli

SUBCOMMANDS = [["generate"], ["chat"], ["info"], ["bench"], ["serve"]]


@pytest.mark.parametrize("sub", SUBCOMMANDS)
def test_help_shows_defaults(sub, capsys):
    with pytest.raises(SystemExit) as exit_:
        cli.main([*sub, "--help"])
    assert exit_.value.code == 0
    out = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    one_user = sub[0] in ("generate", "chat")  # one request at a time: the cache is sized for one
    assert f"requests running at once (default: {1 if one_user else 64})" in out
    assert "tokens per paged block (default: 16)" in out
    assert "(default: auto)" in out and "(default: 0.9)" in out
    assert "default: the model's context where the KV cache can hold one request that long" in out


def test_bench_serve_help_shows_defaults(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench", "serve", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "server base URL (default: http://127.0.0.1:8000)" in out


def _error_lines(argv, capsys) -> list[str]:
    with pytest.raises(SystemExit) as exit_:
        cli.main(argv)
    assert exit_.value.code == 2
    return capsys.readouterr().err.strip().splitlines()


@pytest.mark.parametrize("sub, usage", [
    (["generate", "hi"], "usage: deepinfer generate [options] prompt"),
    (["chat"], "usage: deepinfer chat [options]"),
    (["info"], "usage: deepinfer info [options]"),
    (["bench"], "usage: deepinfer bench [options] [serve]"),
    (["serve"], "usage: deepinfer serve [options]"),
    (["bench", "serve"], "usage: deepinfer bench serve [options]"),
])
def test_an_unknown_flag_prints_the_subcommands_usage(sub, usage, capsys):
    lines = _error_lines([*sub, "--bogus-flag"], capsys)
    name = " ".join(s for s in sub if s != "hi")
    assert lines[0].startswith(usage) and len(lines) == 2
    assert lines[1] == f"deepinfer {name}: error: unrecognized arguments: --bogus-flag"


def test_a_bad_value_prints_the_subcommands_usage(capsys):
    lines = _error_lines(["serve", "--max-num-seqs", "many"], capsys)
    assert lines[0].startswith("usage: deepinfer serve [options]")
    assert lines[1] == "deepinfer serve: error: argument --max-num-seqs: invalid int value: 'many'"


@pytest.mark.parametrize("value, why", [("notjson", "(Expecting value"), ("[1, 2]", "(a list)")])
def test_hf_overrides_not_json_is_one_error_line(value, why, capsys):
    lines = _error_lines(["info", "--hf-overrides", value], capsys)
    assert len(lines) == 2 and lines[0].startswith("usage: deepinfer info [options]")
    assert lines[1].startswith(f"deepinfer info: error: argument --hf-overrides: not a JSON object: {value!r} {why}")


def test_hf_overrides_json_object_is_parsed():
    args = cli.build_parser().parse_args(["info", "--hf-overrides", '{"sliding_window": 128}'])
    assert args.hf_overrides == {"sliding_window": 128}


def test_revision_and_long_context_flags_reach_the_engine_kwargs():
    from deepinfer.entrypoints.engine_args import engine_kwargs

    args = cli.build_parser().parse_args(["info", "--revision", "main", "--allow-long-max-model-len",
                                          "--gpu-memory-utilization", "0.5"])
    kw = engine_kwargs(args)
    assert (kw["revision"], kw["allow_long_max_model_len"], kw["gpu_memory_utilization"]) == ("main", True, 0.5)
    assert kw["kv_cache_memory"] == "auto"
