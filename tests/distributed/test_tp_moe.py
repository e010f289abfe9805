"""Tiny MoE models (tests/moe_tiny.py) split over 2 gloo ranks give the greedy tokens of one rank.

tensor_parallel_size=2 splits the attention heads (and Qwen2-MoE's dense layer) as the Llama family;
expert_parallel_size=2 gives each rank 4 of the 8 experts, so a sparse block sums the ranks' partial
outputs (experts, and the shared expert on rank 0) with one all_reduce. Rank 0 (this process) never
reads its partner's experts. Two runs: Qwen2-MoE from safetensors in fp32 (log-probabilities within
1e-4; measured 1e-6), and Mixtral from a GGUF file with packed experts (log-probabilities within 5e-4:
the row-parallel sums come in another order and the next layer quantizes its input again, which moves
a value across a rounding step of the activations now and then; measured 4e-5 here, up to 1.6e-4 on
the tiny dense models of test_tp_gguf.py).
Dummy weights are the slices of the one-rank draw; sizes that do not split are refused, naming them.
"""

from __future__ import annotations

import random

import pytest
import torch
from moe_tiny import make_tiny_moe, random_moe_model, tiny_moe_config, write_moe_gguf
from slice_reads import spy_slice_reads

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state

pytestmark = [pytest.mark.multirank]

PROMPT_LENGTHS, MAX_TOKENS = (3, 29, 47), 8


@pytest.fixture(scope="module")
def qwen2_moe_path(tmp_path_factory, tokenizer_dir) -> str:
    return make_tiny_moe("qwen2_moe", str(tmp_path_factory.mktemp("qwen2moe-tp")), tokenizer_dir)


def _generate(path: str, **options) -> list:
    """Greedy completions of three prompts with chunked prefill (16-token steps); no block leaks."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, 49152) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=16, enable_prefix_caching=False, **options) as llm:
        engine = llm.engine
        ids = [engine.add_request(p, params) for p in prompts]
        done = {}
        while engine.has_unfinished_requests():
            done.update((o.request_id, o.outputs[0]) for o in engine.step() if o.finished)
        engine.kv_manager.check_no_leaks()
    return [done[i] for i in ids]


def _assert_same(got: list, want: list, atol: float) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        for i, token in enumerate(w.token_ids):
            assert abs(g.logprobs[i][token].logprob - w.logprobs[i][token].logprob) < atol


def test_two_ranks_give_one_ranks_tokens(qwen2_moe_path, monkeypatch):
    want = _generate(qwen2_moe_path)
    reads = spy_slice_reads(monkeypatch)
    _assert_same(_generate(qwen2_moe_path, tensor_parallel_size=2, expert_parallel_size=2), want, 1e-4)
    experts = [n for n in reads["read"] + reads["narrow"] if ".experts." in n]
    assert experts and all(int(n.split(".experts.")[1].split(".")[0]) < 4 for n in experts), experts
    assert {n for n in reads["narrow"] if ".qkv_proj." in n or ".q_proj." in n}  # attention came sliced


def test_packed_gguf_experts_at_two_ranks(tmp_path):
    hf = random_moe_model(tiny_moe_config("mixtral"))
    path = str(tmp_path / "mixtral.gguf")
    write_moe_gguf(path, "mixtral", hf.config, hf.state_dict(), {"default": "Q8_0"})
    want = _generate(path, quantization="gguf")
    _assert_same(_generate(path, quantization="gguf", tensor_parallel_size=2, expert_parallel_size=2), want, 5e-4)


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(r, n): this process reads tp_rank() == r of tp_size() == n (no group: construction
    and dummy weights run no collective)."""
    return lambda r, n: monkeypatch.setitem(parallel_state._WORLD, "rank", r) or \
        monkeypatch.setitem(parallel_state._WORLD, "size", n)


def _dummy_model(path: str, expert_parallel_size: int = 1):
    from deepinfer.model_executor.loader.source import load_model_source
    from deepinfer.model_executor.model_loader import build_model

    source = load_model_source(path, load_format="dummy")
    return build_model(source, torch.float32, torch.device("cpu"), 64, expert_parallel_size=expert_parallel_size)


def test_dummy_weights_are_slices_of_the_one_rank_draw(qwen2_moe_path, as_rank):
    full = dict(_dummy_model(qwen2_moe_path).named_parameters())
    for rank in range(2):
        as_rank(rank, 2)
        local = dict(_dummy_model(qwen2_moe_path, expert_parallel_size=2).named_parameters())
        moe = "model.layers.0.mlp."
        for name in ("experts.gate_up_proj", "experts.down_proj"):
            torch.testing.assert_close(local[moe + name], full[moe + name].chunk(2)[rank])
        for name in (moe + "gate.weight", moe + "shared_expert.down_proj.weight", moe + "shared_expert_gate.weight"):
            torch.testing.assert_close(local[name], full[name])  # held whole
        qkv = "model.layers.0.self_attn.qkv_proj.weight"
        assert local[qkv].shape[0] == full[qkv].shape[0] // 2


def test_bad_sizes_are_refused_naming_them(qwen2_moe_path, as_rank):
    as_rank(0, 4)
    with pytest.raises(ValueError, match="expert_parallel_size=3 must divide tensor_parallel_size=4"):
        _dummy_model(qwen2_moe_path, expert_parallel_size=3)
    as_rank(0, 2)
    with pytest.raises(ValueError, match="tensor_parallel_size=2 must divide intermediate_size=63"):
        from deepinfer.model_executor.models.moe_llama import Qwen2MoeForCausalLM

        Qwen2MoeForCausalLM(tiny_moe_config("qwen2_moe", intermediate_size=63), 64)
