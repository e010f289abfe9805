"""`deepinfer bench --workload entrypoints` (offline vs server) and `--workload spec` (plain vs
speculative code completion): their arithmetic, the server they start, and a tiny end-to-end spec run."""

from __future__ import annotations

import argparse
import re

import pytest

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.bench.workloads import entrypoints as ep
from deepinfer.entrypoints.bench.workloads import spec


def test_decode_and_request_rates_are_means_over_the_runs():
    r = ep.result("deepinfer-offline", 2, [(0.5, 1.0), (0.5, 2.0)], threads=2)
    assert r.extra["decode_tokens_per_s"] == pytest.approx((128 / 1.0 + 128 / 2.0) / 2)
    assert r.extra["request_tokens_per_s"] == pytest.approx((129 / 1.5 + 129 / 2.5) / 2)
    assert r.workload == "entrypoints-busy2" and r.output_tokens == 256 and r.as_json()["extra"]["busy"] == 2


def test_the_server_gets_the_benchs_model_and_speed_flags():
    args = cli.build_parser().parse_args(["bench", "--workload", "entrypoints", "--model", "m.gguf", "--threads", "2",
                                          "--ctx-size", "2048", "--busy", "2"])
    cmd = ep.serve_command(args, 8123)
    assert cmd[1:4] == ["-m", "deepinfer.entrypoints.cli", "serve"] and args.busy == 2
    flags = dict(zip(cmd[4::2], cmd[5::2], strict=True))
    assert flags == {"--port": "8123", "--host": "127.0.0.1", "--model": "m.gguf", "--threads": "2",
                     "--max-model-len": "2048", "--quantization": "auto", "--dtype": "auto",
                     "--kv-cache-dtype": "auto", "--activation-levels": "auto"}


def test_busy_loops_end_with_the_block():
    with ep.busy_loops(2) as procs:
        assert len(procs) == 2 and all(p.poll() is None for p in procs)  # spinning while the block runs
    assert all(p.returncode is not None for p in procs)  # killed and reaped on exit: no process left
    with ep.busy_loops(0) as none:
        assert none == []


def test_spec_needs_a_draft_model_or_method():
    with pytest.raises(ValueError, match="--workload spec needs --speculative-model"):
        spec.method_of(argparse.Namespace(speculative_method=None, speculative_model=None))
    assert spec.method_of(argparse.Namespace(speculative_method=None, speculative_model="d.gguf")) == "draft_model"


@pytest.mark.bench
def test_spec_end_to_end_on_a_tiny_model(tiny_checkpoint, capsys):
    model = tiny_checkpoint("llama")
    assert cli.main(["bench", "--model", model, "--workload", "spec", "--speculative-method", "ngram",
                     "--max-tokens", "12", "--threads", "1"]) == 0
    text = capsys.readouterr().out
    assert re.search(r"^spec +deepinfer +batch  1 +48 tokens in", text, re.M), text
    assert re.search(r"^spec +deepinfer\+ngram batch 1: acceptance rate", text, re.M), text
    assert "spec     batch 1 outputs deepinfer+ngram vs deepinfer: identical (4 of 4 requests)" in text
