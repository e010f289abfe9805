"""The Triton attention backend, and the choice between it and the torch reference.

The step order is the base backend's (attention/backend.py: load, store, decode reads, prefill);
this backend runs it on the Triton kernel set (layers/kernel_set.py): the store and the decode read
are Triton kernels (ops/triton/store.py, decode_attention.py; paged and ring groups alike, plain
or MXFP8 rows); prefill runs the torch reference (`torch_ref.prefill_attention`).

DeepSeek-V4's attention (compressed groups, sparse MLA with a sink) does not call a backend's
`forward`: bound to this backend, its layers take the same kernel set's sparse MLA, indexer and
grouped-MoE hooks (see DeepseekV4ForCausalLM.bind_caches); GPT-OSS's MXFP4 experts its `mxfp4_experts`.
"""

from __future__ import annotations

import torch

from deepinfer.config import ATTENTION_BACKENDS
from deepinfer.model_executor.layers.attention.backend import AttentionBackend, TorchAttentionBackend
from deepinfer.model_executor.layers.kernel_set import TRITON_KERNELS, KernelSet, kernels_for


class TritonAttentionBackend(AttentionBackend):
    """Store and decode through Triton kernels; prefill through the torch reference."""

    name = "triton"

    def __init__(self):
        super().__init__(TRITON_KERNELS)


def triton_available() -> bool:
    """True when triton imports. Imported here, not at module level: a CPU engine with the torch
    backend never imports triton (nor sets TRITON_INTERPRET)."""
    from deepinfer.model_executor.layers.ops.triton import triton_available as available

    return available()


def check_triton_device(device: torch.device) -> None:
    """ValueError unless Triton can run kernels on `device`: installed, and CUDA or the CPU
    (interpreted there: correct, slow)."""
    from deepinfer.model_executor.layers.ops.triton import PIP_HINT

    if not triton_available():
        raise ValueError(f"attention_backend='triton' needs Triton, which is not installed: {PIP_HINT} "
                         "(or use attention_backend='torch')")
    if device.type not in ("cuda", "cpu"):
        raise ValueError(f"attention_backend='triton' cannot run on device {device} (Triton serves CUDA GPUs, "
                         "and the CPU through its interpreter); use attention_backend='torch'")


def resolve_attention_backend(choice: str, device: torch.device, batch_invariant: bool) -> str:
    """"torch" or "triton" for an `attention_backend` choice; ValueError naming the value and the fix.
    auto: triton on CUDA where Triton is installed (and not in batch-invariant mode), else torch."""
    if choice not in ATTENTION_BACKENDS:
        raise ValueError(f"attention_backend must be one of {', '.join(map(repr, ATTENTION_BACKENDS))}, "
                         f"got {choice!r}")
    if choice == "auto":
        usable = device.type == "cuda" and not batch_invariant
        return "triton" if usable and triton_available() else "torch"
    if choice == "triton":
        check_triton_device(device)
        if batch_invariant:
            raise ValueError("attention_backend='triton' has no batch-invariant mode (DEEPINFER_BATCH_INVARIANT=1); "
                             "use attention_backend='torch' (or 'auto')")
    return choice


def make_attention_backend(choice: str, device: torch.device, batch_invariant: bool) -> AttentionBackend:
    """The backend `attention_backend=choice` names for this device (see resolve_attention_backend)."""
    backend = resolve_attention_backend(choice, device, batch_invariant)
    return attention_backend_on(backend, kernels_for(backend, device), batch_invariant)


def attention_backend_on(backend: str, kernels: KernelSet, batch_invariant: bool) -> AttentionBackend:
    """The backend object of a resolved backend name ("torch" or "triton") on its kernel set."""
    if backend == "triton":
        return TritonAttentionBackend()
    # batch-invariant on the CPU: the CPU set, whose store gives the torch store's bits and whose C++
    # invariant attention (ops/invariant_cpu.cpp) the backend runs; elsewhere the torch set
    return TorchAttentionBackend(batch_invariant, kernels)
