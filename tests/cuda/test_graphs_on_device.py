"""CUDA graphs of decode-only steps on the device: the captured graphs replay the eager engine's
greedy tokens. Under GPU_CHECK_CPU=1 the same requests run through the emulated graphs (the
static buffers without a capture), and the capture-only checks are skipped."""

from __future__ import annotations

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.worker.model_runner import ModelRunner

pytestmark = pytest.mark.cuda

PROMPTS = [list(range(10, 31)), list(range(40, 47)), list(range(100, 113)), list(range(200, 203)),
           list(range(300, 318))]  # 21, 7, 13, 3, 18 tokens
MAX_TOKENS = (3, 9, 5, 7, 4)  # the decode batch shrinks 5 -> 4 -> 3 -> 2 -> 1: buckets 8, 4, 4, 2, 1


@pytest.fixture
def graphs_on_this_device(device, monkeypatch):
    """On the CPU rehearsal, engines take the emulated graph path (nothing to capture there)."""
    monkeypatch.setattr(ModelRunner, "emulate_cuda_graphs", device == "cpu")
    return device


def _engine(path, device, **kwargs):
    return LLM(path, device=device, dtype="float32", attention_backend="triton", max_model_len=64, num_blocks=48,
               block_size=8, max_num_seqs=8, max_num_batched_tokens=128, enable_prefix_caching=False, **kwargs)


def _greedy(llm):
    params = [SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True, logprobs=0) for n in MAX_TOKENS]
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    llm.engine.kv_manager.check_no_leaks()
    return [o.outputs[0] for o in outs]


def test_graphs_give_the_eager_tokens_and_count_replays(graphs_on_this_device, tiny_llama_dir):
    device = graphs_on_this_device
    eager_llm = _engine(tiny_llama_dir, device, enforce_eager=True)
    assert eager_llm.engine.runner.steps.graphs is None
    eager = _greedy(eager_llm)
    llm = _engine(tiny_llama_dir, device)
    graphs = llm.engine.runner.steps.graphs
    assert graphs is not None and graphs.sizes == [1, 2, 4, 8]
    before = graphs.num_replays
    got = _greedy(llm)
    assert graphs.num_replays - before == max(MAX_TOKENS) - 1  # every step after the prefill step
    for ref, mine in zip(eager, got, strict=True):
        assert mine.token_ids == ref.token_ids
        for lp_ref, lp_mine, t in zip(ref.logprobs, mine.logprobs, ref.token_ids, strict=True):
            assert abs(lp_ref[t].logprob - lp_mine[t].logprob) < 1e-3


def test_graphs_are_captured_on_cuda(device, tiny_llama_dir, caplog):
    if device != "cuda":
        pytest.skip("CUDA-only: the CPU has no graphs to capture (the emulated path runs in the test above)")
    with caplog.at_level("INFO", logger="deepinfer.worker"):
        llm = _engine(tiny_llama_dir, device)
    graphs = llm.engine.runner.steps.graphs
    assert graphs is not None and graphs.capture and sorted(graphs.runs) == [1, 2, 4, 8]
    assert all(run.logits.is_cuda for run in graphs.runs.values())
    assert any(r.getMessage().startswith("CUDA graphs captured for decode batch sizes 1, 2, 4, 8")
               for r in caplog.records)
