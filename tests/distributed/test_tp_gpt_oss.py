"""GPT-OSS with its routed experts split over ranks (expert_parallel_size ep): each rank holds and
reads E / ep of the 8 experts of the tiny MXFP4 model (tests/models/test_gpt_oss.py's checkpoint).

- The experts' partial outputs of the ranks of a split add up to the float64 token-by-token
  reference, on the C++ per-expert path and the (interpreted) Triton grouped GEMM alike; with
  ep < tensor_parallel_size only the first holder of each slice computes.
- From a GGUF file (MXFP4 or F32 expert stacks) a rank decodes only its experts' bytes, which equal
  the checkpoint's.
- One two-rank run (tensor_parallel_size=2, expert_parallel_size=2, over gloo) gives one rank's greedy
  tokens and log-probabilities (within 1e-4; measured 9.5e-7), and rank 0 (this process) reads only
  rows [0, 4) of every expert tensor of the safetensors file, never a whole one.
"""

from __future__ import annotations

import random

import pytest
import torch
from models.test_gpt_oss import _tensors, tiny_gpt_oss_config, write_gguf, write_mxfp4_checkpoint
from ops.test_mxfp4 import E, packed_experts, reference_experts, routing

from deepinfer import LLM, SamplingParams
from deepinfer.distributed import parallel_state
from deepinfer.model_executor.layers.kernel_set import CPU_KERNELS, TRITON_KERNELS
from deepinfer.model_executor.layers.mxfp4_moe import OssExperts
from deepinfer.model_executor.layers.ops.mxfp4 import dequantize_mxfp4
from deepinfer.model_executor.layers.parallel_linear import shard_spec_of

pytestmark = [pytest.mark.multirank]

VOCAB, PROMPT_LENGTHS, MAX_TOKENS = 49152, (3, 29, 47), 8
EXPERT_PARAMS = ("gate_up_proj_blocks", "gate_up_proj_scales", "down_proj_blocks", "down_proj_scales",
                 "gate_up_proj_bias", "down_proj_bias")


@pytest.fixture(scope="module")
def mxfp4_path(tmp_path_factory, tokenizer_dir) -> str:
    path = str(tmp_path_factory.mktemp("gpt-oss-ep") / "mxfp4")
    write_mxfp4_checkpoint(path, tokenizer_dir)
    return path


@pytest.fixture
def as_rank(monkeypatch):
    """as_rank(r, n): this process reads tp_rank() == r of tp_size() == n (no group: construction
    and loading run no collective)."""
    return lambda r, n: monkeypatch.setitem(parallel_state._WORLD, "rank", r) or \
        monkeypatch.setitem(parallel_state._WORLD, "size", n)


def _rank_experts(full: OssExperts, expert_parallel_size: int) -> OssExperts:
    """This rank's OssExperts, loaded through its ShardSpecs from the full module's tensors."""
    local = OssExperts(E, full.down_proj_bias.shape[1], full.down_proj_scales.shape[2] * 32, True, full.limit,
                       full.alpha, expert_parallel_size)
    with torch.no_grad():
        for name in EXPERT_PARAMS:
            param, spec = getattr(local, name), shard_spec_of(local, name)
            spec.load(param.data, 0, getattr(full, name).detach(), name)
    return local


@pytest.mark.parametrize("triton", [False, True], ids=["per_expert", "triton"])
def test_partial_outputs_of_a_split_add_up(as_rank, triton):
    full = packed_experts(64, 32, seed=3)
    ids, weights = routing(11, 2, seed=4)  # experts 1 and 4 get no token
    x = torch.randn(11, 64, generator=torch.Generator().manual_seed(5))  # [T, H]
    expected = reference_experts(full, x, ids, weights)  # [T, H] float64
    total = torch.zeros_like(expected)
    for rank in range(2):
        as_rank(rank, 2)
        local = _rank_experts(full, 2)
        assert (local.expert_start, local.num_local) == (4 * rank, 4)
        assert torch.equal(local.down_proj_blocks, full.down_proj_blocks[4 * rank:4 * rank + 4])
        local.bind_kernels(TRITON_KERNELS if triton else CPU_KERNELS)
        with torch.no_grad():
            part = local(x, ids, weights).double()  # [T, H]
        held = ((ids >= 4 * rank) & (ids < 4 * rank + 4)).any(dim=1)  # [T] tokens routed to a held expert
        assert part[held].abs().sum(dim=1).gt(0).all() and not part[~held].any()
        total += part
    torch.testing.assert_close(total, expected, rtol=1e-5, atol=1e-5)


def test_first_holder_of_each_slice_computes(as_rank):
    """tensor_parallel_size 4, expert_parallel_size 2: ranks 0, 1 hold experts 0-3, ranks 2, 3 experts
    4-7; ranks 0 and 2 compute, ranks 1 and 3 add zeros; 8 experts do not split 3 ways."""
    from deepinfer.model_executor.models.gpt_oss import GptOssForCausalLM

    cfg = tiny_gpt_oss_config(vocab_size=64, quantization_config={"quant_method": "mxfp4"})
    spec = GptOssForCausalLM.decoder_spec(cfg)
    held = []
    for rank in range(4):
        as_rank(rank, 4)
        moe = spec.mlp(spec, cfg, 0, 2)  # layer 0's MoE block, expert_parallel_size 2
        held.append((moe.experts.expert_start, moe.experts.num_local, moe.split, moe.computes_experts))
    assert held == [(0, 4, True, True), (0, 4, True, False), (4, 4, True, True), (4, 4, True, False)]
    moe = spec.mlp(spec, cfg, 0, 1)  # ep = 1: every rank holds and computes all experts, no collective
    assert (moe.experts.num_local, moe.split, moe.computes_experts) == (8, False, True)
    as_rank(0, 6)
    with pytest.raises(ValueError, match="num_local_experts=8 is not divisible by expert_parallel_size=3"):
        GptOssForCausalLM(cfg, 32, expert_parallel_size=3)
    assert GptOssForCausalLM.capabilities.expert_parallel


@pytest.mark.parametrize("expert_type", ["MXFP4", "F32"])
def test_gguf_rank_decodes_only_its_experts(mxfp4_path, tmp_path, as_rank, monkeypatch, expert_type):
    """MXFP4 stacks stay packed, F32 ones load dense; either way each rank decodes 4 experts of every
    expert stack and bias, and holds the checkpoint's values of experts [4r, 4r + 4)."""
    import gguf as gguf_py

    from deepinfer.model_executor.loader import gguf, gguf_gpt_oss
    from deepinfer.model_executor.loader.source import load_model_source
    from deepinfer.model_executor.model_loader import build_model

    path = write_gguf(str(tmp_path / "tiny.gguf"), mxfp4_path, gguf_py.GGMLQuantizationType[expert_type])
    decoded: list[int] = []  # experts in each expert stack or bias decoded
    for name in ("ggml_mxfp4_to_hf", "ggml_mxfp4_scales"):
        inner = getattr(gguf_gpt_oss, name)
        monkeypatch.setattr(gguf_gpt_oss, name, lambda data, inner=inner: (decoded.append(data.shape[0]),
                                                                           inner(data))[1])
    dequantize = gguf.dequantize_tensor
    monkeypatch.setattr(gguf, "dequantize_tensor", lambda t, dtype: (
        decoded.append(t.shape[0]) if gguf_gpt_oss.is_expert_stack(t.name) else None, dequantize(t, dtype))[1])
    packed = _tensors(mxfp4_path)
    prefix = "model.layers.1.mlp.experts."
    for rank in range(2):
        as_rank(rank, 2)
        model = build_model(load_model_source(path), torch.float32, torch.device("cpu"), 64, expert_parallel_size=2)
        experts = model.model.layers[1].mlp.experts
        assert experts.packed == (expert_type == "MXFP4")
        held = slice(4 * rank, 4 * rank + 4)
        for proj in ("gate_up_proj", "down_proj"):
            want = dequantize_mxfp4(packed[f"{prefix}{proj}_blocks"][held], packed[f"{prefix}{proj}_scales"][held])
            got = (dequantize_mxfp4(getattr(experts, f"{proj}_blocks"), getattr(experts, f"{proj}_scales"))
                   if experts.packed else getattr(experts, proj).detach().mT)  # [4, out, in]
            assert torch.equal(got, want), proj
            assert torch.equal(getattr(experts, f"{proj}_bias").detach(), packed[f"{prefix}{proj}_bias"][held])
    # per layer and rank: gate, up and down (blocks and scales apart when packed) and 3 biases
    per_layer = 2 * 3 + 3 if expert_type == "MXFP4" else 3 + 3
    assert len(decoded) == 2 * 4 * per_layer and set(decoded) == {4}, decoded


def _spy_expert_reads(monkeypatch) -> list[tuple]:
    """From now on, (name, "read") or (name, dim, start, length) for each expert tensor this process
    reads from safetensors (wrapping loader/hf.iter_safetensors_slices)."""
    from deepinfer.model_executor.loader import hf

    reads: list[tuple] = []
    inner = hf.iter_safetensors_slices

    def spied(files, dtype):
        for name, lazy in inner(files, dtype):
            if ".mlp.experts." in name:
                read, narrow = lazy.read, lazy.narrow
                lazy.read = lambda read=read, name=name: (reads.append((name, "read")), read())[1]
                lazy.narrow = lambda *a, narrow=narrow, name=name: (reads.append((name, *a)), narrow(*a))[1]
            yield name, lazy

    monkeypatch.setattr(hf, "iter_safetensors_slices", spied)
    return reads


def _generate(path: str, **options) -> list:
    """Greedy completions of three prompts (two past the window of 16) with chunked prefill."""
    rng = random.Random(3)
    prompts = [[rng.randrange(3, VOCAB) for _ in range(n)] for n in PROMPT_LENGTHS]
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", block_size=8, num_blocks=64, max_model_len=128, max_num_seqs=4,
             max_num_batched_tokens=16, enable_prefix_caching=False, **options) as llm:
        outs = llm.generate(prompts, params, use_tqdm=False)
    return [out.outputs[0] for out in outs]


def test_two_ranks_split_the_experts(mxfp4_path, monkeypatch):
    want = _generate(mxfp4_path)
    reads = _spy_expert_reads(monkeypatch)
    got = _generate(mxfp4_path, tensor_parallel_size=2, expert_parallel_size=2)
    worst = 0.0
    for g, w in zip(got, want, strict=True):
        assert g.token_ids == w.token_ids
        worst = max(worst, *(abs(g.logprobs[i][t].logprob - w.logprobs[i][t].logprob)
                             for i, t in enumerate(w.token_ids)))
    assert worst < 1e-4, worst
    names = {r[0] for r in reads}
    assert len(names) == 4 * len(EXPERT_PARAMS)  # every expert tensor of the 4 layers, each read once, sliced
    assert sorted(r[1:] for r in reads) == [(0, 0, 4)] * len(names), reads
