"""`deepinfer bench --tensor-parallel-size 2` (CPU, gloo): it runs, prints its throughput and the
size it ran at, and stops its ranks: every engine it builds is closed before the next one starts
and before bench returns, so no worker outlives it."""

from __future__ import annotations

import json
import os
import re
import sys

import pytest
from tp_processes import run_watching_workers, still_alive, workers

from deepinfer.entrypoints import cli

pytestmark = [pytest.mark.multirank]

TOK_S = r"tokens in +\d+\.\d+ s = +\d+\.\d+ tok/s"


def test_a_two_rank_bench_prints_its_size_and_throughput_and_leaves_no_worker(tiny_checkpoint, tmp_path):
    out = tmp_path / "bench.json"
    args = [sys.executable, "-m", "deepinfer.entrypoints.cli", "bench", "--model", tiny_checkpoint("llama"),
            "--device", "cpu", "--tensor-parallel-size", "2", "--max-model-len", "256", "--workload", "decode1",
            "--workload", "cpu32", "--num-requests", "2", "--max-tokens", "8", "--json", str(out)]
    res, seen = run_watching_workers(args, timeout_s=120)
    assert res.returncode == 0, res.stderr
    assert re.search(r"^engine +llama, \w+ on cpu, tensor-parallel-size 2, max-model-len 256$", res.stdout, re.M), \
        res.stdout
    assert re.search(rf"^decode1 +deepinfer +8 {TOK_S}$", res.stdout, re.M), res.stdout
    assert re.search(rf"^cpu32 +deepinfer +16 {TOK_S}$", res.stdout, re.M), res.stdout
    results = json.loads(out.read_text())
    assert [(r["workload"], r["output_tokens"]) for r in results] == [("decode1", 8), ("cpu32", 16)]
    assert all(r["tokens_per_s"] > 0 for r in results)
    assert len(seen) == 1, seen  # rank 1, and no other rank, ran beside bench
    assert not still_alive(sorted(seen)), "a tensor-parallel worker outlived bench"


@pytest.mark.bench
def test_bench_closes_each_two_rank_engine_before_the_next_and_before_it_returns(tiny_checkpoint, capsys):
    """The copy workload builds two engines (plain, then ngram) in one process: the second can only
    join a process group once the first has left its own; bench returns with no worker running."""
    argv = ["bench", "--model", tiny_checkpoint("llama"), "--device", "cpu", "--tensor-parallel-size", "2",
            "--max-model-len", "512", "--num-blocks", "128", "--workload", "copy", "--max-tokens", "8"]
    before = set(workers(os.getpid()))
    assert cli.main(argv) == 0, capsys.readouterr().err
    text = capsys.readouterr().out
    for batch in (1, 8):
        assert re.search(rf"^copy +deepinfer +batch +{batch} +\d+ {TOK_S}$", text, re.M), text
        assert re.search(rf"^copy +deepinfer\+ngram +batch +{batch} +\d+ {TOK_S}$", text, re.M), text
        assert f"batch {batch} outputs deepinfer+ngram vs deepinfer: identical (8 of 8 requests)" in text, text
    assert not set(workers(os.getpid())) - before, "bench returned with its ranks still running"
