"""Rotary position embedding (rotate-half layout, as in HF checkpoints).

Inverse frequencies for scaled variants (llama3, yarn, linear, longrope, ...) come from
transformers' ROPE_INIT_FUNCTIONS, so a config means the same thing here as in transformers.

Partial rotary (Phi-4-mini's `partial_rotary_factor`): with R = 2 * len(inv_freq) < D, the first R
dims of each head rotate and the other D - R pass through, as HF's apply_rotary_pos_emb does.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.model_executor.layers.ops import fused


def rope_inv_freq(config, head_dim: int, rope_parameters: dict | None = None, layer_type: str | None = None,
                  default_theta: float | None = None, seq_len: int | None = None) -> tuple[torch.Tensor, float]:
    """(inv_freq [head_dim/2], attention_scaling) for a config's rope parameters.

    `rope_parameters` defaults to the config's; models with one RoPE per layer kind pass that
    kind's dict and `layer_type`, which transformers' scaled variants read. `seq_len`: the length
    transformers' variants that depend on it (longrope's factor set) are asked for.
    """
    fields = HFConfigFields.of(config)
    params = rope_parameters or fields.rope_parameters or {}
    rope_type = params.get("rope_type", "default")
    if rope_type == "default":
        fallback = default_theta if default_theta is not None else fields.rope_theta
        theta = params.get("rope_theta", fallback)
        exponent = torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim  # [head_dim/2]
        return (1.0 / theta**exponent).float(), 1.0
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    if rope_type not in ROPE_INIT_FUNCTIONS:
        raise ValueError(f"rope_type {rope_type!r} is not supported; known: {sorted(ROPE_INIT_FUNCTIONS)}")
    kwargs = {"layer_type": layer_type} if layer_type else {}
    if seq_len is not None:
        kwargs["seq_len"] = seq_len
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](config, None, **kwargs)
    return inv_freq.float(), float(scaling)


class RotaryEmbedding(nn.Module):
    """Applies RoPE to q [T, H, D] and k [T, H_kv, D] at `positions` [T]: to the first
    R = 2 * len(inv_freq) dims of each head (all of them when R = D)."""

    def __init__(self, inv_freq: torch.Tensor, max_positions: int, scaling: float = 1.0):
        super().__init__()
        pos = torch.arange(max_positions, dtype=torch.float32)
        freqs = torch.outer(pos, inv_freq)  # [P, R/2]
        emb = torch.cat((freqs, freqs), dim=-1)  # [P, R]
        self.rotary_dim = emb.shape[-1]
        self.register_buffer("cos", emb.cos() * scaling, persistent=False)  # [P, R]
        self.register_buffer("sin", emb.sin() * scaling, persistent=False)  # [P, R]
        self._last: tuple | None = None  # (positions, cos, sin) of the step in flight
        self._rope = fused.rope_op(self._torch_rope)  # the C++ kernel for fp32 CPU tensors, else _torch_rope

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype):
        """cos, sin [T, 1, D] at `positions`; every layer of a step shares one lookup."""
        last = self._last
        if last is None or last[0] is not positions or last[1].dtype != dtype:
            cos = self.cos[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
            sin = self.sin[positions].unsqueeze(1).to(dtype)  # [T, 1, D]
            self._last = last = (positions, cos, sin)
        return last[1], last[2]

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor):
        """-> (q, k) rotated at positions [T]: new tensors, the inputs are not written."""
        r = self.rotary_dim
        if r == q.shape[-1]:
            return self._rope(q, k, positions, self.cos, self.sin)
        q_rot, k_rot = self._rope(q[..., :r], k[..., :r], positions, self.cos, self.sin)  # [T, H, R], [T, H_kv, R]
        return torch.cat((q_rot, q[..., r:]), dim=-1), torch.cat((k_rot, k[..., r:]), dim=-1)  # [T, H, D], [T, H_kv, D]

    def _torch_rope(self, q, k, positions, cos_table, sin_table):
        """The torch reference of `forward` (the tables are this module's `cos`, `sin`)."""
        cos, sin = self.cos_sin(positions, q.dtype)  # [T, 1, D] each
        return _rotate(q, cos, sin), _rotate(k, cos, sin)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)  # [T, H, D/2] each
    rotated = torch.cat((-x2, x1), dim=-1)  # [T, H, D]
    return x * cos + rotated * sin  # [T, H, D]
