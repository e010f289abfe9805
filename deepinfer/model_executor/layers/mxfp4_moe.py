"""GPT-OSS's routed experts: biases, interleaved gate|up rows and a clamped SwiGLU, with MXFP4 weights
kept packed (as the checkpoint stores them) or dense (a checkpoint saved dequantized).

    h    = x @ W1[e]^T + b1[e]                        [n, 2I], gate at columns 2c, up at 2c + 1
    g    = min(gate, L)   u = clamp(up, -L, L)        L = swiglu_limit (7.0)
    act  = (u + 1) * g * sigmoid(alpha * g)           alpha = 1.702
    y    = act @ W2[e]^T + b2[e]                      [n, H]

Parameters carry the checkpoint's names and shapes, so loading copies them as they are:

    packed (MXFP4)   gate_up_proj_blocks uint8 [E, 2I, H/32, 16], gate_up_proj_scales [E, 2I, H/32],
                     down_proj_blocks [E, H, I/32, 16], down_proj_scales [E, H, I/32]   (17 bytes / 32 values)
    dense            gate_up_proj [E, H, 2I], down_proj [E, I, H]                       (HF's [in, out] layout)
    both             gate_up_proj_bias [E, 2I], down_proj_bias [E, H]

Expert parallelism: with `expert_parallel_size` ep > 1 a rank holds experts [start, start + E/ep)
of the E (`expert_piece`): every parameter above has E/ep rows on dim 0 and a ShardSpec, so loading
reads only those experts. Ids stay global; only the (token, expert) pairs of held experts are
computed, the others add nothing to the [T, H] partial output (the model sums the ranks' outputs).

Kernels: packed experts take the bound kernel set's `mxfp4_experts` hook (`bind_kernels`,
layers/kernel_set.py): on the Triton set two grouped GEMM launches (ops/triton/mxfp4.py; under expert
parallelism over the held pairs only, ids made local). Otherwise (a set without the hook, or dense
weights) one expert at a time, ascending, over its rows: packed weights through `mxfp4_matmul` (the
C++ kernel on the CPU: a row's result does not depend on the rows beside it), dense ones through a
matmul; weighted outputs are added per token in fp32, in ascending expert order.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from deepinfer.contracts.weight_storage import MXFP4_BLOCKS, MXFP4_SCALES
from deepinfer.model_executor.layers.kernel_set import KernelSet
from deepinfer.model_executor.layers.ops.mxfp4 import BLOCK, BLOCK_BYTES, mxfp4_matmul, mxfp4_nbytes
from deepinfer.model_executor.layers.parallel_linear import ShardSpec, expert_piece

SWIGLU_ALPHA = 1.702


def oss_swiglu(h: torch.Tensor, alpha: float, limit: float) -> torch.Tensor:
    """h [..., 2I] (gate, up interleaved) -> [..., I]: (clamp(up) + 1) * g * sigmoid(alpha * g), g = min(gate, L)."""
    gate = h[..., ::2].clamp(max=limit)  # [..., I]
    up = h[..., 1::2].clamp(min=-limit, max=limit)  # [..., I]
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))  # [..., I]


def _uint8_param(*shape: int) -> nn.Parameter:
    return nn.Parameter(torch.zeros(*shape, dtype=torch.uint8), requires_grad=False)


class OssExperts(nn.Module):
    """E GPT-OSS experts, of which this rank holds E / expert_parallel_size (all of them with 1).

    forward(x [T, H], topk_ids [T, k] global ids, topk_weights [T, k]) -> [T, H]: the weighted sum
    over the pairs whose expert is held (the whole output when every expert is)."""

    param_storage = {f"{m}_{part}": kind for m in ("gate_up_proj", "down_proj")
                     for part, kind in (("blocks", MXFP4_BLOCKS), ("scales", MXFP4_SCALES))}

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, packed: bool,
                 swiglu_limit: float, swiglu_alpha: float = SWIGLU_ALPHA, expert_parallel_size: int = 1):
        super().__init__()
        if packed and (hidden_size % BLOCK or intermediate_size % BLOCK):
            raise ValueError(f"MXFP4 experts need hidden_size and intermediate_size divisible by {BLOCK}; got "
                             f"hidden_size={hidden_size}, intermediate_size={intermediate_size}")
        self.num_experts, self.packed = num_experts, packed
        self.limit, self.alpha = float(swiglu_limit), float(swiglu_alpha)
        self.grouped_mxfp4: Callable | None = None  # the kernel set's grouped experts hook: set by bind_kernels
        piece = expert_piece(num_experts, expert_parallel_size)  # the rank's experts [start, start + length)
        self.expert_start, self.num_local = piece.start, piece.length
        e, h, i = self.num_local, hidden_size, intermediate_size
        if packed:
            self.gate_up_proj_blocks = _uint8_param(e, 2 * i, h // BLOCK, BLOCK_BYTES)
            self.gate_up_proj_scales = _uint8_param(e, 2 * i, h // BLOCK)
            self.down_proj_blocks = _uint8_param(e, h, i // BLOCK, BLOCK_BYTES)
            self.down_proj_scales = _uint8_param(e, h, i // BLOCK)
        else:
            self.gate_up_proj = nn.Parameter(torch.zeros(e, h, 2 * i))
            self.down_proj = nn.Parameter(torch.zeros(e, i, h))
        self.gate_up_proj_bias = nn.Parameter(torch.zeros(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.zeros(e, h))
        if self.num_local < num_experts:  # every parameter: the held experts' rows of dim 0
            spec = ShardSpec(0, (piece,))
            self.shard_specs = {name: spec for name, _ in self.named_parameters(recurse=False)}

    def bind_kernels(self, kernels: KernelSet) -> None:
        """Packed experts take the set's grouped MXFP4 hook where it has one (the Triton set); dense
        experts, and every set without the hook, loop over the experts."""
        self.grouped_mxfp4 = kernels.mxfp4_experts if self.packed else None

    def weight_bytes(self) -> int:
        """Bytes of the held experts' matrices (packed: blocks + scales), biases excluded."""
        if self.packed:
            return (mxfp4_nbytes(self.gate_up_proj_blocks, self.gate_up_proj_scales)
                    + mxfp4_nbytes(self.down_proj_blocks, self.down_proj_scales))
        return sum(p.numel() * p.element_size() for p in (self.gate_up_proj, self.down_proj))

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self.grouped_mxfp4 is not None:
            return self._grouped(x, topk_ids, topk_weights)  # [T, H]
        return self._per_expert(x, topk_ids, topk_weights)  # [T, H]

    def _grouped(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The kernel set's grouped GEMM over all pairs, or under expert parallelism over the held pairs only
        (ids made local, one pair per row; a host sync to count them), scattered back per token in fp32."""
        mxfp4_experts = self.grouped_mxfp4
        gate_up = (self.gate_up_proj_blocks, self.gate_up_proj_scales, self.gate_up_proj_bias)
        down = (self.down_proj_blocks, self.down_proj_scales, self.down_proj_bias)
        if self.num_local == self.num_experts:
            return mxfp4_experts(x, topk_ids, topk_weights, gate_up, down, self.alpha, self.limit)  # [T, H]
        k = topk_ids.shape[1]
        local = topk_ids.reshape(-1) - self.expert_start  # [T*k] local ids; other ranks' experts fall outside
        pairs = torch.nonzero((local >= 0) & (local < self.num_local)).squeeze(-1)  # [P] held pairs
        tokens = pairs // k  # [P]
        y = mxfp4_experts(x[tokens], local[pairs, None], topk_weights.reshape(-1)[pairs, None], gate_up, down,
                          self.alpha, self.limit)  # [P, H] weighted, in x's dtype
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)  # [T, H]

    def _per_expert(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Each active held expert over its (token, slot) pairs, ascending; an fp32 sum per token."""
        num_tokens, k = topk_ids.shape
        flat = topk_ids.reshape(-1)  # [T*k] global ids
        order = flat.argsort(stable=True)  # [T*k] pairs grouped by expert, ascending
        counts = torch.bincount(flat, minlength=self.num_experts).tolist()  # E (a host sync)
        if len(counts) > self.num_experts:
            raise ValueError(f"topk_ids must lie in [0, {self.num_experts}), got max {int(flat.max())}")
        weights = topk_weights.reshape(-1).float()  # [T*k]
        out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, H]
        start = sum(counts[:self.expert_start])  # where the held experts' pairs begin in `order`
        for expert, count in enumerate(counts[self.expert_start:self.expert_start + self.num_local]):
            if count:
                pairs = order[start:start + count]  # [n]
                y = self.expert(expert, x[pairs // k])  # [n, H] fp32
                out.index_add_(0, pairs // k, y * weights[pairs, None])
                start += count
        return out.to(x.dtype)  # [T, H]

    def expert(self, e: int, x: torch.Tensor) -> torch.Tensor:
        """Held expert `e` (a local index: global id - expert_start) on rows x [n, H] -> fp32 [n, H]."""
        if self.packed:
            gate_up = (self.gate_up_proj_blocks[e], self.gate_up_proj_scales[e])
            down = (self.down_proj_blocks[e], self.down_proj_scales[e])
        else:
            gate_up, down = (self.gate_up_proj[e],), (self.down_proj[e],)  # [H, 2I], [I, H]
        h = self._linear(x, gate_up) + self.gate_up_proj_bias[e].float()  # [n, 2I]
        act = oss_swiglu(h, self.alpha, self.limit)  # [n, I]
        return self._linear(act, down) + self.down_proj_bias[e].float()  # [n, H]

    def _linear(self, x: torch.Tensor, matrix: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """x [n, in] times one held expert matrix -> fp32 [n, out]: (blocks, scales) when packed,
        else (w [in, out],)."""
        if self.packed:  # the C++ kernel on the CPU, else dequantize-then-matmul
            return mxfp4_matmul(x, *matrix)
        return (x @ matrix[0].to(x.dtype)).float()  # [n, out]
