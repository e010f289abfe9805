"""Manifold-constrained hyper-connections (mHC): `hc_mult` residual streams per token.

A decoder layer keeps its residual as N = hc_mult streams, `streams [T, N, H]`. Around each block
(attention, MoE) a `HyperConnection` reads the streams and produces three mixing weights from one
learned projection of the flattened, RMS-normalised streams:
- `pre  [T, N]`: collapses the streams into the block input, `x = sum_j pre_j * s_j`;
- `post [T, N]`: spreads the block output back over the streams;
- `comb [T, N, N]`: mixes the old streams into the new ones; Sinkhorn-Knopp iterations make it
  (nearly) doubly stochastic.
New streams: `s'_k = post_k * y + sum_j comb[j, k] * s_j` (comb is applied transposed).
`HyperHead` collapses the streams once more after the last layer, before the final norm.
Parameter names follow HF checkpoints (`fn`, `base`, `scale`; `hc_fn`, `hc_base`, `hc_scale`).
The mixing weights are always computed in fp32.

With `batch_invariant` (DEEPINFER_BATCH_INVARIANT) every sum over the streams (Sinkhorn's row and
column sums, the collapse, the mix) is a `batch_invariant.pairwise_sum`, elementwise adds in a
fixed order, and `merge(..., fixed_order=True)` mixes without a batched matmul: a token's streams
then do not depend on the other tokens of the call. The projections (`F.linear`) and `sigmoid`
take their invariant forms in `BatchInvariantMode`; the softmax over a row is invariant as it is.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.weight_storage import FP32
from deepinfer.model_executor.layers.batch_invariant import pairwise_sum


def expand_streams(embeds: torch.Tensor, hc_mult: int) -> torch.Tensor:
    """Copy the embeddings into `hc_mult` identical streams: [T, H] -> [T, N, H]."""
    return embeds.unsqueeze(1).expand(-1, hc_mult, -1).contiguous()  # [T, N, H]


def _sum(x: torch.Tensor, dim: int, fixed_order: bool) -> torch.Tensor:
    """x summed over `dim`, kept as a size-1 dim; `fixed_order`: a pairwise tree of elementwise adds."""
    return pairwise_sum(x, dim).unsqueeze(dim) if fixed_order else x.sum(dim=dim, keepdim=True)


def sinkhorn_normalize(comb: torch.Tensor, num_iters: int, eps: float, fixed_order: bool = False) -> torch.Tensor:
    """Project positive matrices [..., N, N] toward doubly stochastic ones.

    Columns are normalised first, then `num_iters - 1` rounds of rows-then-columns; `eps` guards
    every division (the same schedule as DeepSeek's reference). `fixed_order`: pairwise sums.
    """
    comb = comb / (_sum(comb, -2, fixed_order) + eps)  # [..., N, N]
    for _ in range(num_iters - 1):
        comb = comb / (_sum(comb, -1, fixed_order) + eps)
        comb = comb / (_sum(comb, -2, fixed_order) + eps)
    return comb


def _flat_norm(streams: torch.Tensor, eps: float) -> torch.Tensor:
    flat = streams.flatten(1).float()  # [T, N*H]
    return F.rms_norm(flat, (flat.shape[-1],), None, eps)  # [T, N*H]


def _collapse(streams: torch.Tensor, pre: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
    return _sum(pre.unsqueeze(-1) * streams, 1, fixed_order).squeeze(1).to(streams.dtype)  # [T, H]


class HyperConnection(nn.Module):
    """The mHC around one block (HF: `DeepseekV4HyperConnection`).

    Parameters: `fn [(2 + N) * N, N * H]`, `base [(2 + N) * N]`, `scale [3]` (pre, post, comb).
    Use: `x, post, comb = hc(streams)`; `y = block(norm(x))`; `streams = hc.merge(y, streams, post, comb)`.
    """

    batch_invariant = False
    param_storage = dict.fromkeys(("fn", "base", "scale"), FP32)

    def __init__(self, hidden_size: int, hc_mult: int, sinkhorn_iters: int, hc_eps: float, norm_eps: float):
        super().__init__()
        if hc_mult < 1:
            raise ValueError(f"hc_mult must be >= 1, got {hc_mult}")
        if sinkhorn_iters < 1:
            raise ValueError(f"hc_sinkhorn_iters must be >= 1, got {sinkhorn_iters}")
        self.hc_mult, self.sinkhorn_iters = hc_mult, sinkhorn_iters
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        num_mix = (2 + hc_mult) * hc_mult
        self.fn = nn.Parameter(torch.zeros(num_mix, hc_mult * hidden_size, dtype=torch.float32))
        self.base = nn.Parameter(torch.zeros(num_mix, dtype=torch.float32))
        self.scale = nn.Parameter(torch.ones(3, dtype=torch.float32))

    @classmethod
    def from_config(cls, cfg) -> HyperConnection:
        return cls(cfg.hidden_size, cfg.hc_mult, cfg.hc_sinkhorn_iters, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """streams [T, N, H] -> (block input [T, H], post [T, N] fp32, comb [T, N, N] fp32)."""
        n = self.hc_mult
        mixes = F.linear(_flat_norm(streams, self.norm_eps), self.fn.float())  # [T, (2+N)*N]
        pre, post, comb = mixes.split([n, n, n * n], dim=-1)  # [T, N], [T, N], [T, N*N]
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])  # [N], [N], [N*N]
        pre_s, post_s, comb_s = self.scale.float().unbind(0)  # scalars
        pre = torch.sigmoid(pre * pre_s + pre_b) + self.hc_eps  # [T, N]
        post = 2 * torch.sigmoid(post * post_s + post_b)  # [T, N]
        comb = (comb * comb_s + comb_b).unflatten(-1, (n, n))  # [T, N, N]
        comb = torch.softmax(comb, dim=-1) + self.hc_eps  # [T, N, N]
        comb = sinkhorn_normalize(comb, self.sinkhorn_iters, self.hc_eps, self.batch_invariant)  # [T, N, N]
        return _collapse(streams, pre, self.batch_invariant), post, comb

    @staticmethod
    def merge(block_out: torch.Tensor, streams: torch.Tensor, post: torch.Tensor,
              comb: torch.Tensor, fixed_order: bool = False) -> torch.Tensor:
        """New streams [T, N, H] from the block output [T, H] and the streams the block read;
        `fixed_order`: the mix as elementwise products and a pairwise sum over the old streams."""
        dtype = streams.dtype
        spread = post.to(dtype).unsqueeze(-1) * block_out.unsqueeze(1)  # [T, N, H]
        if fixed_order:  # s'_k += sum_j comb[j, k] * s_j
            terms = comb.to(dtype).unsqueeze(-1) * streams.unsqueeze(2)  # [T, N (j), N (k), H]
            return spread + pairwise_sum(terms, dim=1)  # [T, N, H]
        return spread + torch.matmul(comb.to(dtype).transpose(-1, -2), streams)  # [T, N, H]


class HyperHead(nn.Module):
    """Final collapse of the streams before the model's last norm (HF: `DeepseekV4HyperHead`).

    Parameters: `hc_fn [N, N * H]`, `hc_base [N]`, `hc_scale [1]`.
    """

    batch_invariant = False
    param_storage = dict.fromkeys(("hc_fn", "hc_base", "hc_scale"), FP32)

    def __init__(self, hidden_size: int, hc_mult: int, hc_eps: float, norm_eps: float):
        super().__init__()
        self.hc_mult, self.hc_eps, self.norm_eps = hc_mult, hc_eps, norm_eps
        self.hc_fn = nn.Parameter(torch.zeros(hc_mult, hc_mult * hidden_size, dtype=torch.float32))
        self.hc_base = nn.Parameter(torch.zeros(hc_mult, dtype=torch.float32))
        self.hc_scale = nn.Parameter(torch.ones(1, dtype=torch.float32))

    @classmethod
    def from_config(cls, cfg) -> HyperHead:
        return cls(cfg.hidden_size, cfg.hc_mult, cfg.hc_eps, cfg.rms_norm_eps)

    def forward(self, streams: torch.Tensor) -> torch.Tensor:
        """streams [T, N, H] -> [T, H]."""
        mixes = F.linear(_flat_norm(streams, self.norm_eps), self.hc_fn.float())  # [T, N]
        pre = torch.sigmoid(mixes * self.hc_scale.float() + self.hc_base.float()) + self.hc_eps  # [T, N]
        return _collapse(streams, pre, self.batch_invariant)  # [T, H]
