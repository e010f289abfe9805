"""GGUF files and quantized weights split over tensor-parallel ranks.

- A GGUF slice (loader/gguf_slice.py) decodes to the whole tensor's decoding cut the same way, for
  every ggml type the two shipped models hold, dense or kept quantized.
- Tiny GGUF models (llama: q/k rows interleaved per head; qwen3: one KV head, replicated; gemma3:
  ring layers, tied quantized embedding) and int8/int4 quantized HF checkpoints at 2 gloo ranks give
  the logits of one rank; weights stay packed on each rank (or, quantization='none', dense) and split
  tensors are never read whole.
- The real Gemma 3 270M (Q4_K_M: Q4_K, Q5_0, Q6_K, Q8_0) and SmolLM2 135M (Q4_1, llama layout) at 2
  and 3 ranks score one rank's greedy tokens as one rank does (within the int8 activation rounding's reach).
"""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGML_QUANT_SIZES
from llamacpp_writer import random_hf_model, tiny_hf_config, write_gguf
from test_parallel_layers import run_ranks
from tiny_models import run_steps

from deepinfer import LLM, SamplingParams
from deepinfer.contracts.plan import ScheduledRequest
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref
from deepinfer.model_executor.layers.parallel_linear import RowParallelLinear
from deepinfer.model_executor.layers.quant_linear import (
    QuantLinear,
    QuantRowParallelLinear,
    QuantVocabParallelEmbedding,
)
from deepinfer.model_executor.loader import gguf_slice
from deepinfer.model_executor.loader.gguf import iter_gguf_slices
from deepinfer.model_executor.loader.gguf_file import read_gguf_file
from deepinfer.model_executor.loader.source import load_model_source

pytestmark = [pytest.mark.multirank]


def _dense(x) -> torch.Tensor:
    return dequantize_ref(x) if isinstance(x, QuantWeight) else x.float()


def _slices(path: str, keep_quantized: bool) -> dict:
    source = load_model_source(path)
    tensors = read_gguf_file(path).tensors
    arch = source.hf_config.model_type.replace("_text", "")
    return dict(iter_gguf_slices(tensors, arch, source.hf_config, torch.float32, keep_quantized))


def _cuts(shape) -> list[tuple[int, int, int]]:
    """(dim, start, length): each half of the rows and of the columns, and columns that cut blocks."""
    n, k = shape
    return [(0, 0, n // 2), (0, n // 2, n - n // 2), (1, 0, k // 2), (1, k // 2, k - k // 2), (1, 16, 48)]


@pytest.mark.real_model
@pytest.mark.parametrize("keep_quantized", [False, True], ids=["dense", "packed"])
def test_a_slice_decodes_as_the_whole_tensor_cut(gemma3_gguf_path, keep_quantized):
    slices = _slices(gemma3_gguf_path, keep_quantized)
    layer0 = "model.layers.0."
    names = {"Q8_0": "model.embed_tokens.weight", "Q5_0": layer0 + "self_attn.q_proj.weight",
             "Q4_K": layer0 + "self_attn.o_proj.weight", "Q6_K": layer0 + "mlp.down_proj.weight"}
    for kind, name in names.items():
        lazy = slices[name]
        assert lazy.tensor.tensor_type.name == kind
        if kind == "Q8_0":  # the 262k-row table: cut a few rows of it only
            lazy.tensor = lazy.tensor.__class__(lazy.tensor.name, lazy.tensor.tensor_type, (512, 640),
                                                lazy.tensor.data[:512])
            lazy.shape = torch.Size((512, 640))
        whole = _dense(lazy.read())  # [N, K]
        block = 256 if kind.endswith("_K") else 32  # values per ggml block
        for dim, start, length in _cuts(lazy.shape):
            part = lazy.narrow(dim, start, length)
            packed = keep_quantized and (dim == 0 or start % block == 0 and length % block == 0)
            assert isinstance(part, QuantWeight) == packed, (kind, dim, start, length)
            if packed:  # the slice's own blocks, as many bytes as the file holds for them
                block_bytes = GGML_QUANT_SIZES[lazy.tensor.tensor_type][1]
                assert part.kind == kind and part.nbytes == part.shape[0] * part.shape[1] // block * block_bytes
            assert torch.equal(_dense(part), whole.narrow(dim, start, length)), (kind, dim, start, length)
    norm = slices[layer0 + "input_layernorm.weight"]  # 1-D, stored as 1 + w
    assert torch.equal(norm.narrow(0, 100, 200), norm.read()[100:300])


def test_llama_q_rows_come_as_whole_heads(default_gguf_path):
    slices = _slices(default_gguf_path, keep_quantized=True)
    q = slices["model.layers.0.self_attn.q_proj.weight"]  # SmolLM2: 9 heads of 64 rows, Q4_1
    whole = _dense(q.read())
    assert torch.equal(_dense(q.narrow(0, 192, 192)), whole[192:384])  # heads 3..5 of the HF order
    with pytest.raises(ValueError, match="cut its heads of 64 rows"):
        q.narrow(0, 32, 192)


# ---- tiny models at 2 ranks --------------------------------------------------------------------------

# gemma3 keeps intermediate 96: a rank's 48 columns of down_proj cut its blocks of 32 (dequantized there)
TINY = {"llama": ("Q8_0", {"intermediate_size": 128}),
        "qwen3": ("Q4_0", {"num_key_value_heads": 1, "intermediate_size": 128}), "gemma3": ("Q8_0", {})}
TOKENS = [3, 17, 40, 5, 9, 33, 61, 12, 7, 28, 50, 4, 19, 44, 8, 36, 22, 10, 57, 31, 6, 14]
PREFILL, CHUNK = 19, 11  # Gemma 3's window is 16: its rings wrap


def _tiny_gguf(tmp_path, arch: str) -> str:
    import gguf

    qtype, overrides = TINY[arch]
    config = tiny_hf_config(arch, **overrides)
    state = random_hf_model(config).state_dict()
    if config.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    return write_gguf(tmp_path / f"{arch}.gguf", arch, config, state, qtype=gguf.GGMLQuantizationType[qtype])


def _steps(llm: LLM) -> list[ScheduledRequest]:
    """Prefill in two chunks, then one token per step, in blocks 0.. and ring slot 0."""
    groups = llm.engine.runner.groups
    tables = tuple(list(range(8)) for g in groups if not g.is_ring)
    states = tuple(0 for g in groups if g.is_ring)
    cuts = [0, CHUNK, PREFILL] + list(range(PREFILL + 1, len(TOKENS) + 1))
    return [ScheduledRequest("r", TOKENS[a:b], a, tables, states) for a, b in zip(cuts, cuts[1:], strict=False)]


def _logits(path: str, quantization: str) -> tuple[torch.Tensor, LLM]:
    llm = LLM(path, dtype="float32", num_blocks=16, block_size=8, max_model_len=64, max_num_seqs=2,
              enable_prefix_caching=False, quantization=quantization)
    return torch.cat(run_steps(llm, _steps(llm))), llm  # [L, V]


def _spy_whole_reads() -> list[str]:
    """Names of GGUF tensors read whole (GGUFSlice.read) in this process."""
    names: list[str] = []
    inner = gguf_slice.GGUFSlice.read

    def spied(self):
        names.append(self.tensor.name)
        return inner(self)

    gguf_slice.GGUFSlice.read = spied
    return names


def _rank_logits(rank: int, path: str, quantization: str, out: str) -> None:
    reads = _spy_whole_reads()
    logits, llm = _logits(path, quantization)
    modules = dict(llm.engine.runner.model.named_modules())
    layer = "model.layers.0."
    if quantization == "none":  # a GGUF file dequantized: the dense parallel layers, read as slices
        assert type(modules[layer + "self_attn.o_proj"]) is RowParallelLinear
        assert [n for n in reads if n.endswith(".weight") and "norm" not in n] == [], reads
        torch.save(logits, f"{out}/rank{rank}.pt")
        return
    assert isinstance(modules[layer + "self_attn.qkv_proj"], QuantLinear)  # the rank's q|k|v rows, packed
    assert isinstance(modules[layer + "self_attn.o_proj"], QuantRowParallelLinear)
    o_proj = modules[layer + "self_attn.o_proj"]
    assert [w.shape[1] for w in o_proj.qweights] == [o_proj.in_features]
    if quantization == "gguf":
        assert isinstance(modules["model.embed_tokens"], QuantVocabParallelEmbedding)
        down = modules[layer + "mlp.down_proj"]
        if _cuts_blocks(llm):  # 48 of 96 columns cut a Q8_0 block: dequantized
            assert type(down) is RowParallelLinear and down.weight.shape[1] == 48
        else:
            assert isinstance(down, QuantRowParallelLinear)
        assert [n for n in reads if n.endswith(".weight") and "norm" not in n] == [], reads
    torch.save(logits, f"{out}/rank{rank}.pt")


def _cuts_blocks(llm: LLM) -> bool:
    """Whether a rank's half of the MLP's inner size cuts blocks of 32."""
    return llm.engine.source.hf_config.intermediate_size // 2 % 32 != 0


@pytest.mark.parametrize("arch, quantization", [(arch, "gguf") for arch in TINY] + [("gemma3", "none")])
def test_gguf_at_two_ranks_equals_one_rank(arch, quantization, tmp_path):
    """Each rank quantizes the same activation blocks as one rank does, so only fp32 sum order
    differs; where a rank's columns cut blocks (gemma3 here), its down_proj multiplies dequantized
    with fp32 activations, one rank's with int8 ones."""
    path = _tiny_gguf(tmp_path, arch)
    run_ranks(_rank_logits, tmp_path, path, quantization, str(tmp_path))
    one, llm = _logits(path, quantization)  # [L, V]
    cut = quantization == "gguf" and _cuts_blocks(llm)
    for rank in range(2):
        split = torch.load(tmp_path / f"rank{rank}.pt")
        if cut:  # int8 against fp32 activations in one layer: within 2% of the largest logit, same argmax
            assert (split - one).abs().max() < 0.02 * one.abs().max()
            assert torch.equal(split.argmax(-1), one.argmax(-1))
        else:
            assert_split_close(split, one)


@pytest.mark.parametrize("scheme", ["int8", "int4"])
def test_quantized_at_load_at_two_ranks_equals_one_rank(scheme, tiny_checkpoint, tmp_path):
    path = tiny_checkpoint("llama")  # intermediate 128, hidden 64: each rank's K a multiple of 32
    run_ranks(_rank_logits, tmp_path, path, scheme, str(tmp_path))
    one, _ = _logits(path, scheme)
    for rank in range(2):
        assert_split_close(torch.load(tmp_path / f"rank{rank}.pt"), one)


def assert_split_close(split: torch.Tensor, one: torch.Tensor) -> None:
    """Logits of a split model against one rank's. A row-parallel layer's partial sums are added in
    another order, and the next layer quantizes its input again: where that moves a value across a
    rounding boundary of the activations' second level (steps of ~1/32000 of a block's largest
    value), a logit moves by about 1e-4 (measured up to 1.6e-4 on these tiny models). A wrong shard
    or a missing all-reduce moves them by whole units."""
    torch.testing.assert_close(split, one, atol=1e-3, rtol=1e-3)
    assert torch.equal(split.argmax(-1), one.argmax(-1))


# ---- the shipped models --------------------------------------------------------------------------

PROMPTS = ["The capital of France is", "Once upon a time"]


def _greedy(model: str) -> list[list[int]]:
    """One rank's prompts followed by its 12 greedy tokens, and each of those tokens' logprobs."""
    params = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=0)
    with LLM(model, max_model_len=96) as llm:
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
    return [(o.prompt_token_ids + list(o.outputs[0].token_ids),
             [step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids, strict=True)])
            for o in outs]


def _scored(model: str, tp: int, sequences: list[list[int]]) -> list[list]:
    """Each sequence's tokens (after the first) as `tp` ranks score them, teacher-forced: (logprob, rank)."""
    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
    with LLM(model, tensor_parallel_size=tp, max_model_len=96) as llm:
        outs = llm.generate([{"prompt_token_ids": ids} for ids in sequences], params, use_tqdm=False)
    return [[(step[t].logprob, step[t].rank) for step, t in zip(o.prompt_logprobs[1:], ids[1:], strict=True)]
            for o, ids in zip(outs, sequences, strict=True)]


@pytest.mark.real_model
@pytest.mark.slow
@pytest.mark.parametrize("model, tp", [("gemma3-270m", 2), ("smollm2-135m", 3)])
def test_shipped_gguf_models_split_score_one_ranks_tokens(model, tp, gemma3_gguf_path):
    """One rank's greedy tokens, scored by the split model under teacher forcing. The split sums a
    row-parallel product's parts in another fp32 order, which the next layer's int8 activation
    rounding turns into differences of that rounding's own size (measured: up to 0.22 nats; one
    rank's dequantized fp32 path differs from its integer path by up to 0.27): free-running greedy
    runs may part at a near tie, so the split model scores the same tokens, each within 0.4 nats of
    one rank's logprob and among its top 3."""
    one = _greedy(model)
    split = _scored(model, tp, [ids for ids, _ in one])
    for (_, want), got in zip(one, split, strict=True):
        generated = got[-len(want):]  # the prompt's own tokens come first
        assert all(rank <= 3 for _, rank in generated), generated
        torch.testing.assert_close(torch.tensor([lp for lp, _ in generated]), torch.tensor(want), atol=0.4, rtol=0)
