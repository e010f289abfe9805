"""CUDA graphs of decode-only steps (worker/cuda_graphs.py), on the CPU: buckets, which steps
qualify, and the padded static-buffer path emulated (ModelRunner.emulate_cuda_graphs: "capture"
keeps the eager forward, "replay" runs it over the static buffers, Triton interpreted) giving the
eager run's greedy tokens. The captured graphs themselves: tests/cuda/test_graphs_on_device.py."""

import argparse
import os
import sys

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.contracts.cache import PAGED, RING, CacheGroupSpec, RowSpec
from deepinfer.contracts.model import ModelCapabilities
from deepinfer.contracts.plan import ScheduledRequest, StepPlan
from deepinfer.entrypoints.engine_args import add_engine_args, engine_kwargs
from deepinfer.worker.cuda_graphs import DecodeGraphs, capture_sizes, graphs_off_reason
from deepinfer.worker.input_batch import build_step_inputs
from deepinfer.worker.model_runner import ModelRunner

PROMPTS = [list(range(10, 31)), list(range(40, 47)), list(range(100, 113))]  # 21, 7, 13 tokens
GREEDY = SamplingParams(temperature=0, logprobs=1, ignore_eos=True)
TOKEN_GROUPS = [CacheGroupSpec("full", PAGED, (0,), rows_per_unit=4, row=RowSpec(2, 16)),
                CacheGroupSpec("swa", RING, (1,), rows_per_unit=22, window=16, row=RowSpec(2, 16))]


@pytest.fixture
def emulated(monkeypatch):
    """Engines built in this test take the graph path without CUDA (nothing is captured)."""
    monkeypatch.setattr(ModelRunner, "emulate_cuda_graphs", True)


def make_llm(path, **kwargs):
    options = dict(attention_backend="triton", device="cpu", dtype="float32", num_blocks=32, block_size=4,
                   max_num_seqs=4, max_num_batched_tokens=64, max_model_len=48, enable_prefix_caching=False)
    return LLM(path, **{**options, **kwargs})


def test_buckets_are_powers_of_two_then_multiples_of_eight():
    assert capture_sizes(1) == [1]
    assert capture_sizes(3) == [1, 2, 4]
    assert capture_sizes(8) == [1, 2, 4, 8]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 24]
    assert capture_sizes(64) == [1, 2, 4, 8, *range(16, 65, 8)]
    assert capture_sizes(1000)[-1] == 256 and capture_sizes(1000, limit=32)[-1] == 32


def test_a_step_takes_the_smallest_bucket_that_holds_it():
    graphs = DecodeGraphs(None, TOKEN_GROUPS, 40, [1, 2, 4, 8], torch.device("cpu"), capture=False)
    assert [graphs.bucket(n) for n in range(1, 9)] == [1, 2, 4, 4, 8, 8, 8, 8]
    assert graphs.max_batch == 8
    assert [tuple(i.shape) for i in graphs.decode_index] == [(8, 40), (8, 16)]  # paged: max_model_len; ring: W
    assert all(bool((s == -1).all()) for s in graphs.store_slots)


class _GraphSafe:
    capabilities = ModelCapabilities(graph_safe_decode=True)


class _Eager:
    capabilities = ModelCapabilities(tensor_parallel=True)


@pytest.mark.parametrize("kwargs,reason", [
    (dict(enforce_eager=True), "enforce_eager"),
    (dict(device=torch.device("cpu")), "device cpu"),
    (dict(backend="torch"), "attention backend 'torch'"),
    (dict(groups=TOKEN_GROUPS + [CacheGroupSpec("csa", PAGED, (1,), rows_per_unit=4, compress_ratio=4,
                                                row=RowSpec(1, 64, shared_kv=True))]), "DeepSeek-V4 runs eager"),
    (dict(model=_Eager()), "_Eager does not declare graph_safe_decode"),  # e.g. a sliding-only V4: token groups only
])
def test_graphs_are_off_where_they_cannot_serve(kwargs, reason):
    args = dict(enforce_eager=False, device=torch.device("cuda"), backend="triton", groups=TOKEN_GROUPS,
                model=_GraphSafe())
    assert graphs_off_reason(**args) is None
    assert reason in graphs_off_reason(**{**args, **kwargs})
    assert graphs_off_reason(**{**args, "device": torch.device("cpu")}, emulate=True) is None


def _request(rid, n, start, **kw):
    return ScheduledRequest(rid, list(range(5, 5 + n)), start, ([0, 1, 2],), sampling_params=GREEDY, **kw)


def test_only_plain_decode_steps_qualify(tiny_checkpoint, emulated):
    runner = make_llm(tiny_checkpoint("llama")).engine.runner
    graphs = runner.steps.graphs

    def accepts(*scheduled):
        return graphs.accepts(build_step_inputs(StepPlan(list(scheduled)), runner.caches.addressing, runner.device))

    decodes = [_request(f"d{i}", 1, 3 + i) for i in range(3)]
    assert accepts(*decodes) and accepts(decodes[0])
    assert not accepts(*decodes, _request("p", 4, 0))  # a prefill chunk beside decodes
    assert not accepts(_request("p", 4, 0))
    assert not accepts(*decodes[:2], _request("v", 3, 6, verify=True))  # verification of 2 drafts
    assert not accepts(_request("lp", 1, 7, prompt_logprobs=1))
    assert not accepts(ScheduledRequest("ns", [5], 7, ([0, 1],)))  # a token that does not sample
    assert not accepts(*[_request(f"d{i}", 1, 3) for i in range(5)])  # 5 > Bmax = 4


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_emulated_graphs_give_the_eager_tokens(tiny_checkpoint, arch, monkeypatch):
    """Three requests decode together (padded to bucket 4), then two, then one: every token and
    logprob as the eager engine's; the static buffers served every decode-only step."""
    path = tiny_checkpoint(arch)
    params = [SamplingParams(max_tokens=n, temperature=0, logprobs=1, ignore_eos=True) for n in (2, 3, 4)]
    eager = make_llm(path)
    assert eager.engine.runner.steps.graphs is None  # the CPU captures nothing by default
    ref = [o.outputs[0] for o in eager.generate(PROMPTS, params, use_tqdm=False)]
    monkeypatch.setattr(ModelRunner, "emulate_cuda_graphs", True)
    llm = make_llm(path)
    graphs = llm.engine.runner.steps.graphs
    assert graphs.sizes == [1, 2, 4]
    batches = []
    run = graphs.run
    monkeypatch.setattr(graphs, "run", lambda inputs: batches.append(len(inputs.spans)) or run(inputs))
    got = [o.outputs[0] for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    llm.engine.kv_manager.check_no_leaks()
    assert batches == [3, 2, 1] and graphs.num_replays == 3  # step 1 prefills all three, eager
    for r, m in zip(ref, got, strict=True):
        assert m.token_ids == r.token_ids
        for j, t in enumerate(r.token_ids):
            assert abs(m.logprobs[j][t].logprob - r.logprobs[j][t].logprob) < 1e-4


@pytest.mark.slow
def test_enforce_eager_turns_graphs_off(tiny_checkpoint, emulated):
    assert make_llm(tiny_checkpoint("llama")).engine.runner.steps.graphs is not None
    assert make_llm(tiny_checkpoint("llama"), enforce_eager=True).engine.runner.steps.graphs is None
    assert make_llm(tiny_checkpoint("llama"), attention_backend="torch").engine.runner.steps.graphs is None


@pytest.mark.parametrize("layers", [["SLIDING", "SLIDING"], ["SLIDING", "CSA"]])
def test_deepseek_v4_runs_eager(tmp_path, emulated, layers):
    """Token groups alone (a sliding-only V4) or with compressed groups: no graphs either way."""
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "models", "deepseek_v4"))
    import v4_tiny

    v4_tiny.make_tiny_v4(str(tmp_path), [getattr(v4_tiny, kind) for kind in layers])
    runner = make_llm(str(tmp_path)).engine.runner
    assert runner.attention_backend.name == "triton" and runner.steps.graphs is None


def test_enforce_eager_flag_and_field():
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--enforce-eager"]))["enforce_eager"] is True
    assert engine_kwargs(parser.parse_args([]))["enforce_eager"] is False
    assert EngineConfig(enforce_eager=True).enforce_eager is True
    with pytest.raises(ValueError, match="enforce_eager must be True or False, got 'yes'"):
        EngineConfig(enforce_eager="yes")
