"""Device-resident steps: a decode step's inputs reach the device in one copy, and its forward and
sampling never make the host wait for the device until the sampled tokens are read (once).

On CUDA one decode step of `LLM.generate` runs under `torch.cuda.set_sync_debug_mode("error")`,
lifted only for the sampler's one read (`read_samples`): any other synchronizing call raises. The
CPU has no such mode, so under GPU_CHECK_CPU=1 that test is skipped; the storage tests run there
too, packing on purpose (`pack=True`), since the CPU keeps a step's tensors as they are built.
"""

from __future__ import annotations

import random

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers import sampler as sampler_module
from deepinfer.worker import step_executor as runner_module
from deepinfer.worker.input_batch import build_step_inputs, is_decode

pytestmark = pytest.mark.cuda

SAMPLING = {
    "greedy": [SamplingParams(temperature=0.0, logprobs=2)] * 3,
    "random": [SamplingParams(temperature=0.8, top_p=0.9, top_k=20), SamplingParams(temperature=1.0, top_p=0.7),
               SamplingParams(temperature=0.6, min_p=0.05, logprobs=1)],
    "mixed": [SamplingParams(temperature=0.0), SamplingParams(temperature=0.8, top_p=0.9, top_k=20, logprobs=3),
              SamplingParams(temperature=1.0, top_p=0.8)],
}


@pytest.fixture(scope="module")
def tiny_dirs(tiny_llama_dir, tmp_path_factory) -> dict[str, str]:
    """The conftest's tiny Llama, and a tiny Qwen3 and Gemma 3 (sliding layers: a ring group)."""
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    dirs = {"llama": tiny_llama_dir}
    for arch in ("qwen3", "gemma3"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        dirs[arch] = str(tmp_path_factory.mktemp(f"cuda-tiny-{arch}"))
        model.save_pretrained(dirs[arch])
    return dirs


def _llm(path: str, device: str, eager: bool = True) -> LLM:
    backend = "triton" if device == "cuda" and _has_triton() else "torch"
    return LLM(path, device=device, dtype="float32", max_model_len=128, num_blocks=32, block_size=8,
               attention_backend=backend, enforce_eager=eager)


def _has_triton() -> bool:
    from deepinfer.model_executor.layers.attention.triton_backend import triton_available

    return triton_available()


def _prompts(n: int) -> list[list[int]]:
    rng = random.Random(5)
    return [[rng.randrange(3, 1000) for _ in range(rng.randint(5, 30))] for _ in range(n)]


def _plain_decode(plan) -> bool:
    return bool(plan.scheduled) and all(is_decode(s) and s.num_tokens == 1 for s in plan.scheduled)


class _GuardedStep:
    """Runs the `skip`-th plain decode step of the runner under the sync debug mode "error"; the
    sampler's read lifts it. Records what raised and how many reads the step made."""

    def __init__(self, runner, monkeypatch, skip: int = 2):
        self.real_execute, self.real_read = runner.execute, sampler_module.read_samples
        self.skip, self.ran, self.reads, self.errors = skip, False, 0, []
        monkeypatch.setattr(runner, "execute", self.execute)
        monkeypatch.setattr(sampler_module, "read_samples", self.read)

    def execute(self, plan):
        if self.ran or not _plain_decode(plan):
            return self.real_execute(plan)
        if self.skip:  # warm-up decode steps (kernel compilation, first pinned buffers)
            self.skip -= 1
            return self.real_execute(plan)
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            output = self.real_execute(plan)
        except Exception as exc:
            self.errors.append(repr(exc))
            raise
        finally:
            torch.cuda.set_sync_debug_mode(0)
            self.ran = True
        self.errors += list(output.errors.values())
        return output

    def read(self, drawn, metadata):
        mode = torch.cuda.get_sync_debug_mode()
        self.reads += bool(mode)
        torch.cuda.set_sync_debug_mode(0)
        try:
            return self.real_read(drawn, metadata)
        finally:
            torch.cuda.set_sync_debug_mode(mode)


@pytest.mark.parametrize(("arch", "sampling", "eager"), [
    ("llama", "greedy", True), ("llama", "random", True), ("llama", "mixed", True), ("qwen3", "mixed", True),
    ("gemma3", "mixed", True), ("llama", "mixed", False)])  # eager False: the decode step may replay a CUDA graph
def test_a_decode_step_syncs_only_to_read_its_tokens(device, tiny_dirs, monkeypatch, arch, sampling, eager):
    if device != "cuda":
        pytest.skip("torch.cuda.set_sync_debug_mode exists only on CUDA (the storage tests run on the CPU too)")
    llm = _llm(tiny_dirs[arch], device, eager)
    guard = _GuardedStep(llm.engine.runner, monkeypatch)
    params = [_with_length(p) for p in SAMPLING[sampling]]
    outputs = llm.generate(_prompts(len(params)), params, use_tqdm=False)
    assert guard.ran, "no plain decode step was guarded"
    assert guard.errors == []
    assert guard.reads == 1  # one read for the whole batch: tokens, logprobs, ranks, top logprobs
    assert all(len(o.outputs[0].token_ids) == 6 for o in outputs)
    llm.close()


def _with_length(p: SamplingParams) -> SamplingParams:
    return SamplingParams(temperature=p.temperature, top_p=p.top_p, top_k=p.top_k, min_p=p.min_p,
                          logprobs=p.logprobs, max_tokens=6, ignore_eos=True)


def _decode_plan(llm: LLM, monkeypatch):
    """A plain decode plan of `llm`'s runner, recorded during a short generate."""
    runner, plans = llm.engine.runner, []
    real = runner.execute

    def recording(plan):
        if _plain_decode(plan):
            plans.append(plan)
        return real(plan)

    monkeypatch.setattr(runner, "execute", recording)
    llm.generate(_prompts(3), _with_length(SamplingParams(temperature=0.0)), use_tqdm=False)
    monkeypatch.setattr(runner, "execute", real)
    assert plans, "generate ran no plain decode step"
    return plans[-1]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_a_steps_tensors_share_one_device_storage(device, tiny_dirs, monkeypatch, arch):
    llm = _llm(tiny_dirs[arch], device)
    runner = llm.engine.runner
    plan = _decode_plan(llm, monkeypatch)
    inputs = build_step_inputs(plan, runner.caches.addressing, runner.device, pack=None if device == "cuda" else True)
    tensors = [t for t in [inputs.input_ids, inputs.sample_index, *inputs.attn_metadata.tensors()] if t is not None]
    assert len(tensors) >= 4
    assert {t.device.type for t in tensors} == {device}
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    llm.close()


def test_packed_steps_give_the_same_tokens(device, tiny_dirs, monkeypatch):
    """Greedy tokens and logprobs of a chunked run are the same whether a step's tensors are views
    of one packed buffer (forced on the CPU) or built one by one (the CPU's default)."""
    prompts = _prompts(4)
    params = SamplingParams(temperature=0.0, logprobs=0, max_tokens=8, ignore_eos=True)
    runs = []
    for pack in (None, True):
        monkeypatch.setattr(runner_module, "build_step_inputs",
                            lambda plan, addressing, dev, _pack=pack: build_step_inputs(plan, addressing, dev, _pack))
        llm = LLM(tiny_dirs["gemma3"], device=device, dtype="float32", max_model_len=128, num_blocks=32,
                  block_size=8, max_num_batched_tokens=23, attention_backend="torch", enforce_eager=True)
        runs.append([o.outputs[0] for o in llm.generate(prompts, params, use_tqdm=False)])
        llm.close()
    for plain, packed in zip(*runs, strict=True):
        assert packed.token_ids == plain.token_ids
        for lp_plain, lp_packed, t in zip(plain.logprobs, packed.logprobs, plain.token_ids, strict=True):
            assert lp_packed[t].logprob == pytest.approx(lp_plain[t].logprob, abs=1e-5)
