"""The Triton attention backend, and the choice between it and the torch reference.

Same contract and order as the reference (attention/backend.py): prefill segments load their
cached rows first, then the step's rows are stored, then decode queries read through their index
rows, then prefill queries attend over [loaded rows | chunk rows]. The store and the decode read
are Triton kernels (ops/triton/store.py, decode_attention.py; paged and ring groups alike, plain
or MXFP8 rows); prefill runs the torch reference (`torch_ref.prefill_attention`).

DeepSeek-V4's attention (compressed groups, sparse MLA with a sink) does not call a backend's
`forward`: bound to this backend, its layers take their own Triton kernels (ops/triton/sparse_mla.py,
indexer.py, moe.py; see DeepseekV4ForCausalLM.bind_caches).
"""

from __future__ import annotations

import torch

from deepinfer.config import ATTENTION_BACKENDS
from deepinfer.model_executor.layers.attention.backend import AttentionBackend, AttentionMetadata, GroupMetadata
from deepinfer.model_executor.layers.attention.torch_ref import TorchAttentionBackend, prefill_attention


class TritonAttentionBackend(AttentionBackend):
    """Store and decode through Triton kernels; prefill through the torch reference."""

    name = "triton"

    def __init__(self):
        from deepinfer.model_executor.layers.ops.triton import decode_attention, store

        self._store, self._decode = store.store_layer_rows, decode_attention.decode_layer_attention

    def forward(self, cache, q, k, v, metadata: AttentionMetadata, group: GroupMetadata,
                scale: float) -> torch.Tensor:
        md, g = metadata, group
        loaded = [cache.load(seg.load_slots) for seg in g.prefills]  # 1. load before store
        rows = g.store_rows
        self._store(cache, g.store_slots, k if rows is None else k[rows], v if rows is None else v[rows])  # 2.
        nd = md.num_decode_tokens
        if nd == q.shape[0]:  # a decode-only step
            return self._decode(cache, q, g.decode_index, scale, g.decode_lens)  # [T, H, D]
        out = torch.empty_like(q)  # [T, H, D]
        if nd:  # 3. decode reads
            out[:nd] = self._decode(cache, q[:nd], g.decode_index, scale, g.decode_lens)
        for seg, old in zip(g.prefills, loaded, strict=True):  # 4. prefill over [old | chunk]
            s, e = seg.token_start, seg.token_end
            out[s:e] = prefill_attention(q[s:e], k[s:e], v[s:e], old, md.positions[s:e], seg.load_positions,
                                         scale, g.window)
        return out


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
    if resolve_attention_backend(choice, device, batch_invariant) == "triton":
        return TritonAttentionBackend()
    return TorchAttentionBackend(batch_invariant)
