"""`deepinfer bench --workload copy`: plain against speculative decoding on the same requests, the
printed lines and the JSON; the acceptance line of any workload run with a speculative method."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace

import pytest

from deepinfer.entrypoints import cli
from deepinfer.entrypoints.bench.common import BenchResult, spec_between
from deepinfer.entrypoints.bench.workloads.copy import COPY_TASKS, _compare, copy_workload, repeated_span_prompts

TOK_S = r"\d+ tokens in +\d+\.\d+ s = +\d+\.\d+ tok/s"


@pytest.mark.bench
def test_copy_bench_runs_plain_and_speculative_on_a_tiny_model(tiny_checkpoint, tmp_path, capsys):
    out = tmp_path / "copy.json"
    assert cli.main(["bench", "--model", tiny_checkpoint("llama"), "--workload", "copy", "--max-tokens", "8",
                     "--num-speculative-tokens", "3", "--num-blocks", "256", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    for engine in ("deepinfer", r"deepinfer\+ngram"):
        for batch in (1, 8):
            assert re.search(rf"^copy +{engine} +batch +{batch} +{TOK_S}$", text, re.M), text
    for batch in (1, 8):
        assert re.search(rf"^copy +deepinfer\+ngram batch {batch}: acceptance rate \d\.\d{{3}} \(\d+ of \d+ draft "
                         r"tokens\), mean accepted length \d\.\d\d over \d+ verification steps$", text, re.M), text
        assert re.search(rf"^copy +batch {batch} deepinfer\+ngram / deepinfer: \d+\.\d\dx$", text, re.M), text
        assert re.search(rf"^copy +batch {batch} outputs deepinfer\+ngram vs deepinfer: identical \(8 of 8 "
                         r"requests\)$", text, re.M), text

    results = json.loads(out.read_text())
    assert [(r["engine"], r["batch"]) for r in results] == [
        ("deepinfer", 1), ("deepinfer", 8), ("deepinfer+ngram", 1), ("deepinfer+ngram", 8)]
    plain, spec = results[:2], results[2:]
    assert all("spec" not in r and "vs_plain" not in r for r in plain)
    for p, s in zip(plain, spec, strict=True):
        assert 0 < s["output_tokens"] == p["output_tokens"] <= 8 * 8
        assert s["tokens_per_s"] == s["output_tokens"] / s["seconds"]
        assert s["vs_plain"] == {"speedup": s["tokens_per_s"] / p["tokens_per_s"], "identical_outputs": True,
                                 "mismatched_requests": []}
        counters = s["spec"]
        assert counters["spec_decode_num_draft_tokens"] > 0  # the chat template repeats itself: drafts
        assert 0 <= counters["spec_decode_num_accepted_tokens"] <= counters["spec_decode_num_draft_tokens"]
        assert len(counters["spec_decode_num_accepted_tokens_per_pos"]) <= 3


@pytest.mark.bench
def test_any_workload_with_a_method_prints_its_acceptance(tiny_checkpoint, capsys):
    assert cli.main(["bench", "--model", tiny_checkpoint("llama"), "--workload", "decode1", "--max-tokens", "8",
                     "--speculative-method", "ngram", "--num-blocks", "64"]) == 0
    text = capsys.readouterr().out
    assert re.search(rf"^decode1 +deepinfer\+ngram +{TOK_S}$", text, re.M), text
    assert re.search(r"^decode1 +deepinfer\+ngram: acceptance rate \d\.\d{3} ", text, re.M), text


@pytest.mark.bench
def test_copy_bench_without_a_tokenizer_runs_token_id_prompts(tmp_path, capsys):
    from tiny_models import tiny_config

    tiny_config("llama").save_pretrained(tmp_path)  # config.json only: dummy weights, no tokenizer
    out = tmp_path / "copy.json"
    assert cli.main(["bench", "--model", str(tmp_path), "--load-format", "dummy", "--workload", "copy",
                     "--max-tokens", "5", "--num-blocks", "256", "--json", str(out)]) == 0
    results = json.loads(out.read_text())
    assert [(r["engine"], r["batch"], r["output_tokens"]) for r in results] == [
        ("deepinfer", 1, 40), ("deepinfer", 8, 40), ("deepinfer+ngram", 1, 40), ("deepinfer+ngram", 8, 40)]
    assert all(r["vs_plain"]["identical_outputs"] for r in results[2:])
    assert "outputs deepinfer+ngram vs deepinfer: identical (8 of 8 requests)" in capsys.readouterr().out


def test_copy_workload_without_a_tokenizer_repeats_a_span():
    llm = SimpleNamespace(get_tokenizer=lambda: None,
                          engine=SimpleNamespace(source=SimpleNamespace(hf_config=SimpleNamespace(vocab_size=500))))
    workload = copy_workload(llm, None)
    assert workload.ignore_eos and workload.output_lens == [128] * len(COPY_TASKS) == [128] * 8
    assert len({tuple(p) for p in workload.prompts}) == 8
    for prompt in workload.prompts:
        tail = prompt[-8:]
        starts = [i for i in range(len(prompt) - 8) if prompt[i:i + 8] == tail]
        assert starts == [32], "the tail must start the span repeated from position 32"
        assert all(100 <= t < 500 for t in prompt)
    assert repeated_span_prompts(500, 2, seed=1) != repeated_span_prompts(500, 2, seed=0)


def test_copy_workload_uses_the_chat_template(tiny_checkpoint):
    from deepinfer import LLM

    llm = LLM(tiny_checkpoint("llama"), num_blocks=16, max_model_len=256)
    workload = copy_workload(llm, 20)
    assert not workload.ignore_eos and workload.output_lens == [20] * 8
    first = llm.get_tokenizer().decode(workload.prompts[0])
    assert first.startswith("<|im_start|>") and COPY_TASKS[0][:40] in first and first.endswith("assistant\n")
    assert all(150 <= len(p) <= 600 for p in workload.prompts), [len(p) for p in workload.prompts]


def _metrics(drafts: int, draft_tokens: int, accepted: int, per_pos: list[int]) -> dict:
    return {"spec_decode_num_drafts": drafts, "spec_decode_num_draft_tokens": draft_tokens,
            "spec_decode_num_accepted_tokens": accepted, "spec_decode_num_accepted_tokens_per_pos": per_pos}


def test_spec_between_takes_deltas_per_position():
    s = spec_between(_metrics(2, 6, 3, [2, 1]), _metrics(5, 15, 9, [4, 3, 2]))
    assert (s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, s.accepted_per_position) == (3, 9, 6, [2, 2, 2])
    assert s.acceptance_rate == 6 / 9 and s.mean_accepted_length == 1 + 6 / 3


def test_a_mismatch_is_reported(capsys):
    plain = [(BenchResult("deepinfer", "copy", 2.0, 6, batch=1), [[1, 2, 3], [4, 5, 6]])]
    spec = [(BenchResult("deepinfer+ngram", "copy", 1.0, 6, batch=1), [[1, 2, 3], [4, 5, 7]])]
    results = _compare(plain, spec)
    assert [r.engine for r in results] == ["deepinfer", "deepinfer+ngram"]
    assert results[1].vs_plain == {"speedup": 2.0, "identical_outputs": False, "mismatched_requests": [1]}
    text = capsys.readouterr().out
    assert "copy     batch 1 deepinfer+ngram / deepinfer: 2.00x" in text
    assert "copy     batch 1 outputs deepinfer+ngram vs deepinfer: MISMATCH in 1 of 2 requests " \
           "(request 1 from token 2)" in text
