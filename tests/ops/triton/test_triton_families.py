"""attention_backend="triton" on the families the Llama/Gemma 3 tests (test_triton_backend.py), GPT-OSS
(models/test_gpt_oss.py) and DeepSeek-V3/V4 tests leave out: Gemma 2 (soft-capped local/global
layers), Phi-3 (a window on every layer: rings only), the MoE Llama family and DeepSeek-V2 (MLA).

Each family's tiny random fp32 checkpoint (tests/family_checkpoints.py) runs through the engine twice,
on the torch reference backend and on the Triton kernel set (interpreted on the CPU: TRITON_INTERPRET=1
is set by ops/triton before triton is imported); greedy tokens must be equal and their logprobs within
1e-3. Prefill is cut into chunks of 8 tokens, so one request's decode rows share a step with another's
prefill chunk that reads cached rows, and the 21-token prompt passes the 16-token windows.

The MoE Llama family: Qwen3-MoE, Qwen2-MoE and Mixtral are one model class (models/moe_llama.py:
Llama's attention, `FusedExperts` bound to the backend's kernel set); Qwen2-MoE stands for all three,
as its variant adds the most to that shared path (q/k/v bias, a gated shared expert beside the routed
experts of the Triton grouped GEMM); Qwen3-MoE (q/k norm) and Mixtral (no dense layers) run too, at
a few seconds each.
"""

from __future__ import annotations

import collections
import importlib

import pytest
from family_checkpoints import make_family_checkpoint

from deepinfer import LLM, SamplingParams

pytestmark = pytest.mark.parity  # engine sweeps like test_triton_backend.py's (tests/conftest.py PARITY_MODULES)

# the Triton kernels each family must reach: (module under ops/triton, function) -> the hook's name
KERNELS = {("store", "store_layer_rows"): "store", ("decode_attention", "decode_layer_attention"): "decode",
           ("sparse_mla", "decode_mla_mqa_sparse"): "sparse_mla", ("moe", "fused_experts"): "grouped_moe"}
EXPECTED = {"gemma2": {"store", "decode"}, "phi3": {"store", "decode"},
            "qwen2_moe": {"store", "decode", "grouped_moe"}, "qwen3_moe": {"store", "decode", "grouped_moe"},
            "mixtral": {"store", "decode", "grouped_moe"}, "deepseek_v2": {"store", "sparse_mla", "grouped_moe"}}
PROMPTS = [list(range(10, 31)), list(range(40, 47))]  # 21 and 7 tokens
PARAMS = SamplingParams(max_tokens=3, temperature=0, logprobs=1, ignore_eos=True)
ENGINE = dict(device="cpu", dtype="float32", num_blocks=32, block_size=4, max_num_seqs=2,
              max_num_batched_tokens=8, max_model_len=64, kv_cache_memory="16MiB", enable_prefix_caching=False)


@pytest.fixture
def plain_torch_backend(monkeypatch):
    """DEEPINFER_BATCH_INVARIANT=0 for both engines: the Triton backend is refused under the
    batch-invariant CPU default, and the torch backend's plain kernels are the reference."""
    from deepinfer.environ import get_environ

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    get_environ.cache_clear()
    yield
    monkeypatch.undo()
    get_environ.cache_clear()


@pytest.fixture
def triton_calls(monkeypatch) -> collections.Counter:
    """Counts calls into the Triton kernel modules (by hook name), so a family that quietly keeps
    to its torch path fails the test instead of comparing the reference with itself."""
    calls: collections.Counter = collections.Counter()
    for (module_name, function), hook in KERNELS.items():
        module = importlib.import_module(f"deepinfer.model_executor.layers.ops.triton.{module_name}")
        monkeypatch.setattr(module, function, _counted(getattr(module, function), hook, calls))
    return calls


def _counted(fn, hook: str, calls: collections.Counter):
    def wrapper(*args, **kwargs):
        calls[hook] += 1
        return fn(*args, **kwargs)

    return wrapper


def generate(path: str, backend: str) -> list:
    """Greedy completions of PROMPTS in one batch on `backend`; every block back in the pool."""
    with LLM(path, attention_backend=backend, **ENGINE) as llm:
        assert llm.engine.runner.attention_backend.name == backend
        outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
        llm.engine.kv_manager.check_no_leaks()
    return [o.outputs[0] for o in outs]


def assert_same_completions(ref: list, mine: list, atol: float = 1e-3) -> None:
    """Equal greedy tokens, and each sampled token's logprob within `atol` of the reference's."""
    for r, m in zip(ref, mine, strict=True):
        assert m.token_ids == r.token_ids
        for j, t in enumerate(r.token_ids):
            assert abs(m.logprobs[j][t].logprob - r.logprobs[j][t].logprob) < atol, (j, m.logprobs[j], r.logprobs[j])


@pytest.mark.parametrize("family", sorted(EXPECTED))
def test_triton_backend_matches_the_torch_backend(family, tmp_path, tokenizer_dir, plain_torch_backend, triton_calls):
    """The family runs on the Triton path (the README's claim): its Triton kernels are called, and
    its tokens and logprobs agree with the torch reference backend's."""
    make_family_checkpoint(family, str(tmp_path), tokenizer_dir)
    ref = generate(str(tmp_path), "torch")
    assert not triton_calls, "the reference engine ran no Triton kernel"
    assert_same_completions(ref, generate(str(tmp_path), "triton"))
    assert EXPECTED[family] <= set(triton_calls), dict(triton_calls)
