"""attention_backend="triton": the engine's tokens and logprobs match the torch reference backend
(tiny Llama, paged; tiny Gemma 3, rings + paged), fp32 and MXFP8 rows, with chunked prefill and
decode sharing steps; and the option is chosen and refused as documented."""

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.config import EngineConfig
from deepinfer.entrypoints.engine_args import add_engine_args, engine_kwargs
from deepinfer.model_executor.layers.attention import triton_backend
from deepinfer.model_executor.layers.attention.triton_backend import TritonAttentionBackend, resolve_attention_backend
from deepinfer.worker.summary import startup_summary

pytestmark = [pytest.mark.parity]

PROMPTS = [list(range(10, 31)), list(range(40, 47)), list(range(100, 113))]  # 21, 7, 13 tokens
PARAMS = SamplingParams(max_tokens=3, temperature=0, logprobs=1, ignore_eos=True)


def generate(path, backend, kv_cache_dtype):
    """Greedy outputs of three prompts in one batch; chunks of 8 tokens, so decode rows of early
    requests share steps with prefill chunks that load cached rows."""
    llm = LLM(path, attention_backend=backend, device="cpu", dtype="float32", kv_cache_dtype=kv_cache_dtype,
              num_blocks=32, block_size=4, max_num_seqs=4, max_num_batched_tokens=8, max_model_len=64,
              kv_cache_memory="16MiB", enable_prefix_caching=False)
    assert llm.engine.runner.attention_backend.name == backend
    outs = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    llm.engine.kv_manager.check_no_leaks()
    return [o.outputs[0] for o in outs]


@pytest.fixture
def plain_torch_backend(monkeypatch):
    """The torch backend's own decode and prefill, not its batch-invariant ones (the CPU default),
    which attend to a chunk's own keys as an fp8 cache returns them: the Triton kernels, like the
    plain path, use the chunk's exact keys."""
    from deepinfer.environ import get_environ

    monkeypatch.setenv("DEEPINFER_BATCH_INVARIANT", "0")
    get_environ.cache_clear()
    yield
    monkeypatch.undo()
    get_environ.cache_clear()


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_triton_backend_matches_the_torch_backend(tiny_checkpoint, plain_torch_backend, arch, kv_cache_dtype):
    path = tiny_checkpoint(arch)
    ref, mine = generate(path, "torch", kv_cache_dtype), generate(path, "triton", kv_cache_dtype)
    for r, m in zip(ref, mine, strict=True):
        assert m.token_ids == r.token_ids
        for j, t in enumerate(r.token_ids):
            assert abs(m.logprobs[j][t].logprob - r.logprobs[j][t].logprob) < 1e-3, (j, m.logprobs[j], r.logprobs[j])


def test_the_start_up_line_names_the_backend(tiny_checkpoint):
    llm = LLM(tiny_checkpoint("llama"), attention_backend="triton", device="cpu", num_blocks=8, block_size=4,
              max_model_len=32, kv_cache_memory="4MiB")
    assert isinstance(llm.engine.runner.attention_backend, TritonAttentionBackend)
    assert "attention triton" in startup_summary(llm.engine.runner, 32, 0.0)


def test_auto_is_triton_on_cuda_and_torch_on_the_cpu():
    assert resolve_attention_backend("auto", torch.device("cpu"), False) == "torch"
    assert resolve_attention_backend("auto", torch.device("cuda"), False) == "triton"
    assert resolve_attention_backend("auto", torch.device("cuda"), True) == "torch"  # batch invariant
    assert resolve_attention_backend("torch", torch.device("cuda"), False) == "torch"


@pytest.mark.parametrize("invariant,device,shown", [
    (True, "cpu", "DEEPINFER_BATCH_INVARIANT"),
    (False, "mps", "cannot run on device mps"),
])
def test_triton_is_refused_where_it_cannot_serve(invariant, device, shown):
    with pytest.raises(ValueError, match=shown) as info:
        resolve_attention_backend("triton", torch.device(device), invariant)
    assert "attention_backend='torch'" in str(info.value)


def test_triton_missing_is_a_start_up_error_naming_the_fix(monkeypatch, tiny_checkpoint):
    monkeypatch.setattr(triton_backend, "triton_available", lambda: False)
    with pytest.raises(ValueError, match=r"attention_backend='triton' needs Triton.*pip install triton"):
        LLM(tiny_checkpoint("llama"), attention_backend="triton", device="cpu", num_blocks=8, block_size=4)
    assert resolve_attention_backend("auto", torch.device("cuda"), False) == "torch"


def test_a_bad_choice_names_the_field_and_value():
    with pytest.raises(ValueError, match="attention_backend must be one of 'auto', 'torch', 'triton', got 'cuda'"):
        EngineConfig(attention_backend="cuda")


def test_the_flag_reaches_the_engine_arguments():
    import argparse

    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_kwargs(parser.parse_args(["--attention-backend", "triton"]))["attention_backend"] == "triton"
    assert engine_kwargs(parser.parse_args([]))["attention_backend"] == "auto"
    with pytest.raises(SystemExit):
        parser.parse_args(["--attention-backend", "flash"])
