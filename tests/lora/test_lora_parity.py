"""Multi-LoRA parity with PEFT + transformers on a tiny random Llama.

One batch mixes three adapters of different ranks and targets (4 on q/v; 8 on all seven projections;
16 with rsLoRA on k/o/gate/up/down) and the base model, with chunked prefill (a 16-token budget,
prompts up to 30 tokens) and forced preemption (10 blocks of 8 tokens for 8 requests). Every greedy
token must be PEFT's argmax with the right adapter active (teacher forcing over the whole sequence,
no cache), and every reported logprob within 1e-4 of PEFT's (fp32). The same at two tensor-parallel
ranks, with one device slot for the three adapters (they wait for it, and are loaded again), with
n-gram speculative decoding, and over a quantized base (int8 at load: the delta is added beside the
integer matmul, the packed weights untouched).
"""

from __future__ import annotations

import pytest
import torch
from lora_adapters import (
    ADAPTER_SPECS,
    PeftReference,
    assert_matches_reference,
    make_adapters,
    random_prompts,
)

from deepinfer import LLM, LoRARequest, SamplingParams

NAMES = ["a", "b", "c", None] * 2
PROMPTS = random_prompts(8, 10, 31)
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3, ignore_eos=True)
SMALL = dict(dtype="float32", enable_lora=True, max_lora_rank=16, block_size=8, max_model_len=64,
             max_num_batched_tokens=16)


@pytest.fixture(scope="module")
def setup(tiny_checkpoint, tmp_path_factory):
    base = tiny_checkpoint("llama")
    adapters = make_adapters(base, tmp_path_factory.mktemp("adapters"))
    return base, adapters, PeftReference(base, adapters)


def _requests(adapters: dict[str, str]) -> list[LoRARequest | None]:
    ids = {name: i + 1 for i, name in enumerate(ADAPTER_SPECS)}
    return [None if n is None else LoRARequest(n, ids[n], adapters[n]) for n in NAMES]


def _check(llm: LLM, ref: PeftReference, adapters: dict[str, str], prompts=PROMPTS, params=GREEDY,
           atol: float = 1e-4) -> float:
    outs = llm.generate(prompts, params, lora_request=_requests(adapters)[:len(prompts)], use_tqdm=False)
    pairs = zip(prompts, NAMES[:len(prompts)], outs, strict=True)
    return max(assert_matches_reference(ref, n, p, o.outputs[0], atol) for p, n, o in pairs)


def test_the_adapters_change_the_model(setup):
    """The reference is sensitive: each adapter moves PEFT's logprobs far beyond the tolerance."""
    base, adapters, ref = setup
    prompt = PROMPTS[0]
    plain = ref.logprobs(None, prompt, [5, 6, 7])
    for name in ADAPTER_SPECS:
        assert (ref.logprobs(name, prompt, [5, 6, 7]) - plain).abs().max() > 0.1, name


def test_mixed_batch_with_chunks_and_preemption_matches_peft(setup):
    base, adapters, ref = setup
    with LLM(base, max_loras=3, num_blocks=10, **SMALL) as llm:
        worst = _check(llm, ref, adapters)
        assert llm.get_metrics()["num_preemptions"] > 0
        assert llm.engine.runner.lora.num_loads == 3  # each adapter loaded once, in its own slot
    assert worst < 1e-4


def test_one_slot_serves_three_adapters_in_turn(setup):
    """max_loras=1: a request waits until its adapter can have the slot; no running request's
    adapter is ever replaced under it (its tokens would leave PEFT's)."""
    base, adapters, ref = setup
    with LLM(base, max_loras=1, num_blocks=40, **SMALL) as llm:
        _check(llm, ref, adapters)
        assert llm.engine.runner.lora.num_loads >= 3


def test_ngram_speculative_decoding_with_adapters(setup):
    base, adapters, ref = setup
    prompts = [p[:6] * 4 for p in PROMPTS[:4]]  # repeated runs: the proposer finds drafts
    params = SamplingParams(max_tokens=12, temperature=0.0, logprobs=2, ignore_eos=True)
    with LLM(base, max_loras=3, num_blocks=40, speculative_method="ngram", num_speculative_tokens=3,
             **SMALL) as llm:
        _check(llm, ref, adapters, prompts, params)
        assert llm.get_metrics()["spec_decode_num_draft_tokens"] > 0


@pytest.mark.multirank
def test_two_tensor_parallel_ranks_match_peft(setup):
    """A split like the base: B by output rows on q|k|v and gate|up, A by input columns on o and down."""
    base, adapters, ref = setup
    with LLM(base, max_loras=3, num_blocks=10, tensor_parallel_size=2, **SMALL) as llm:
        _check(llm, ref, adapters)


def test_gemma3_base(tiny_checkpoint, tmp_path):
    base = tiny_checkpoint("gemma3")
    adapters = make_adapters(base, tmp_path, {"a": ADAPTER_SPECS["b"], "b": ADAPTER_SPECS["c"]})
    ref = PeftReference(base, adapters)
    with LLM(base, max_loras=2, num_blocks=40, **SMALL) as llm:
        outs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=[
            LoRARequest("a", 1, adapters["a"]), LoRARequest("b", 2, adapters["b"]), None])
        for prompt, name, out in zip(PROMPTS, ["a", "b", None], outs, strict=False):
            assert_matches_reference(ref, name, prompt, out.outputs[0])


# ---- a quantized base: the delta beside the integer matmul ------------------------------------------

def _dequantized_reference(base: str, adapters: dict[str, str]) -> PeftReference:
    """PEFT over the base whose linear weights are what int8 quantization at load keeps (Q8_0 blocks)."""
    from deepinfer.model_executor.layers.ops.qmatmul import dequantize_ref, quantize_weight

    ref = PeftReference(base, adapters)
    with torch.no_grad():
        for name, m in ref.model.named_modules():
            if type(m) is torch.nn.Linear and "lora" not in name and m.in_features % 32 == 0:
                m.weight.copy_(dequantize_ref(quantize_weight(m.weight, "int8")).reshape(m.weight.shape))
    return ref


def test_int8_base_keeps_its_weights_and_adds_the_delta(setup):
    from deepinfer.model_executor.layers.ops.qmatmul import qmatmul
    from deepinfer.model_executor.layers.quant_linear import QuantLinear

    base, adapters, _ = setup
    with LLM(base, quantization="int8", max_loras=3, num_blocks=40, **SMALL) as llm:
        runner = llm.engine.runner
        qkv = runner.model.model.layers[0].self_attn.qkv_proj
        assert isinstance(qkv, QuantLinear)
        before = [w.data.clone() for w in qkv.qweights]
        # measured: at most 2.3e-4 from PEFT over the dequantized weights (the integer kernels quantize
        # activations to int8 per 32 values; PEFT's float matmul does not)
        _check(llm, _dequantized_reference(base, adapters), adapters, atol=1e-3)
        assert all(torch.equal(b, w.data) for b, w in zip(before, qkv.qweights, strict=True))  # never merged
        slot = runner.lora.held.index(llm.engine.adapters.resolve(LoRARequest("b", 2, adapters["b"])).fingerprint)
        x = torch.randn(3, qkv.in_features)  # [T, in]
        slots = torch.tensor([slot, -1, slot])
        with runner.lora.model.active(slots, frozenset([slot])):
            y = qkv(x)  # [T, out]
        _assert_beside(qkv, x, y, adapters["b"], ADAPTER_SPECS["b"], qmatmul(x, qkv.qweights))


def _assert_beside(qkv, x, y, path: str, spec: dict, base_y: torch.Tensor) -> None:
    """Rows 0 and 2: qmatmul + scale * (x A^T) B^T per piece, from the adapter file; row 1: qmatmul alone."""
    from safetensors.torch import load_file

    tensors = load_file(f"{path}/adapter_model.safetensors")
    prefix = "base_model.model.model.layers.0.self_attn."
    deltas = [(x @ tensors[f"{prefix}{n}.lora_A.weight"].T) @ tensors[f"{prefix}{n}.lora_B.weight"].T
              for n in ("q_proj", "k_proj", "v_proj")]
    expected = base_y + torch.cat(deltas, dim=-1) * (spec["alpha"] / spec["r"])  # [T, out]
    assert torch.equal(y[1], base_y[1])
    torch.testing.assert_close(y[[0, 2]], expected[[0, 2]], rtol=1e-5, atol=1e-5)


@pytest.mark.slow
def test_adapted_rows_do_not_depend_on_the_batch(setup):
    """On the CPU default path (batch-invariant) a request's logprobs are bit-identical alone, in one
    chunk, and inside the mixed, 16-token-chunked batch: the delta runs through the invariant linear."""
    base, adapters, _ = setup
    requests = _requests(adapters)
    with LLM(base, max_loras=3, num_blocks=40, **SMALL) as llm:
        assert llm.engine.runner.batch_invariant
        batch = llm.generate(PROMPTS, GREEDY, lora_request=requests, use_tqdm=False)
    with LLM(base, max_loras=3, num_blocks=40, **{**SMALL, "max_num_batched_tokens": 64}) as llm:
        alone = [llm.generate([p], GREEDY, lora_request=r, use_tqdm=False)[0]
                 for p, r in zip(PROMPTS, requests, strict=True)]

    def bits(out) -> list:
        return [out.outputs[0].token_ids] + [{t: lp.logprob for t, lp in d.items()} for d in out.outputs[0].logprobs]

    assert [bits(o) for o in alone] == [bits(o) for o in batch]
