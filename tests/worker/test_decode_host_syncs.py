"""A plain decode step's forward and sampling run no op that makes the host wait for the device.

The CPU cannot show a wait, so this rehearses the CUDA path on it: the fused CPU kernels are off
(`fused.kernel_isa` -> 0: the torch code CUDA runs), the sampler takes its device paths
(`host_reads_are_free` -> False), and every aten op of the runner's `_forward` and the sampler's
`draw` is recorded (a TorchDispatchMode). Ops that read a device value on the host (`item`,
`bool(t)`, `nonzero`, boolean-mask indexing, `equal`, ...) must not appear. The sampled tokens are
read once, after `draw` (`read_samples`). tests/cuda/test_device_resident.py checks the same on
CUDA with `torch.cuda.set_sync_debug_mode("error")`.
"""

from __future__ import annotations

import random

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from deepinfer import LLM, SamplingParams
from deepinfer.model_executor.layers import token_draws
from deepinfer.model_executor.layers.ops import fused
from deepinfer.worker.input_batch import is_decode

# aten ops that, on a CUDA tensor, copy a value to the host and wait for it
HOST_READS = {"aten._local_scalar_dense", "aten.item", "aten.is_nonzero", "aten.nonzero", "aten.masked_select",
              "aten.masked_scatter", "aten.equal", "aten._unique2", "aten.unique_dim", "aten.unique_consecutive",
              "aten.repeat_interleave"}
MASK_INDEXING = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}  # with a bool index

PARAMS = [SamplingParams(temperature=0.0, logprobs=2, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.8, top_p=0.9, top_k=20, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=1.0, top_p=0.7, logprobs=1, max_tokens=5, ignore_eos=True),
          SamplingParams(temperature=0.6, min_p=0.05, max_tokens=5, ignore_eos=True)]


class _HostReads(TorchDispatchMode):
    """Records the ops of HOST_READS that run inside it."""

    def __init__(self, seen: list[str]):
        super().__init__()
        self.seen = seen

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in HOST_READS or (name in MASK_INDEXING and _has_mask(args[1])):
            self.seen.append(str(func))
        return func(*args, **(kwargs or {}))


def _has_mask(indices) -> bool:
    """Whether an index list holds a boolean mask (its positions are found with a nonzero)."""
    return any(t is not None and t.dtype in (torch.bool, torch.uint8) for t in indices)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, str]:
    from tiny_models import tiny_config
    from transformers import AutoModelForCausalLM

    dirs = {}
    for arch in ("llama", "qwen3", "gemma3"):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(tiny_config(arch), dtype=torch.float32)
        dirs[arch] = str(tmp_path_factory.mktemp(f"tiny-{arch}"))
        model.save_pretrained(dirs[arch])
    return dirs


def _record_decode_steps(runner, monkeypatch) -> list[list[str]]:
    """Per plain decode step, the host reads its forward and its sampler's `draw` made."""
    steps: list[list[str]] = []
    current: list[list[str] | None] = [None]  # the open step's list while a plain decode step runs
    execute, forward, draw = runner.execute, runner.steps._forward, runner.steps.sampler.draw

    def recording_execute(plan):
        if plan.scheduled and all(is_decode(s) and s.num_tokens == 1 for s in plan.scheduled):
            steps.append([])
            current[0] = steps[-1]
        try:
            return execute(plan)
        finally:
            current[0] = None

    def recorded(fn):
        def run(*args):
            if current[0] is None:
                return fn(*args)
            with _HostReads(current[0]):
                return fn(*args)
        return run

    monkeypatch.setattr(runner, "execute", recording_execute)
    monkeypatch.setattr(runner.steps, "_forward", recorded(forward))
    monkeypatch.setattr(runner.steps.sampler, "draw", recorded(draw))
    return steps


@pytest.mark.parametrize("arch", ["llama", "qwen3", "gemma3"])
def test_decode_forward_and_sampling_never_read_the_device(checkpoints, monkeypatch, arch):
    monkeypatch.setattr(fused, "kernel_isa", lambda: 0)
    monkeypatch.setattr(token_draws, "host_reads_are_free", lambda t: False)
    llm = LLM(checkpoints[arch], device="cpu", dtype="float32", max_model_len=128, num_blocks=32, block_size=8,
              attention_backend="torch")
    steps = _record_decode_steps(llm.engine.runner, monkeypatch)
    rng = random.Random(0)
    prompts = [[rng.randrange(3, 1000) for _ in range(rng.randint(4, 20))] for _ in PARAMS]
    outputs = llm.generate(prompts, PARAMS, use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 for o in outputs)
    assert len(steps) >= 3
    assert steps == [[]] * len(steps)


def test_the_recorder_sees_host_reads():
    seen: list[str] = []
    x = torch.tensor([0.0, 1.0, 2.0])
    with _HostReads(seen):
        bool(x.sum() > 0)
        x[x > 0]
        x.nonzero()
    assert [s.split(".")[1] for s in seen] == ["_local_scalar_dense", "index", "nonzero"]
