"""The Qwen2-VL and Qwen2.5-VL vision towers: patches of pictures -> one row per merged 2x2 patch group.

    pixel_values [N, C*tp*p*p]  (N = sum of t*h*w over the pictures, the processor's patch order:
                                 2x2 merge groups contiguous, row-major over the groups)
      patch_embed               a Conv3d whose kernel is its stride = one linear map per patch  [N, E]
      blocks x depth            x + attn(norm1(x)); x + mlp(norm2(x)), 2D RoPE on q and k       [N, E]
      merger                    norm, 4 neighbouring rows concatenated, Linear-GELU-Linear      [N/4, hidden]

Attention never crosses pictures (nor frames): segments [cu_seqlens[i], cu_seqlens[i+1]) attend
only within themselves. Qwen2-VL: LayerNorm, fc1-QuickGELU-fc2, every block full (per picture).
Qwen2.5-VL: RMSNorm, a gated MLP with biases, and windows: the rows are reordered so each window of
`window_size` pixels (window_size / patch / merge merged groups on a side) is contiguous, blocks
not in `fullatt_block_indexes` attend within windows, and the merged rows are put back in order:

    picture 4x6 merged groups, windows of 2x2 groups:   window order
        a a b b c c                                       a a a a b b b b c c c c
        a a b b c c                                       d d d d e e e e f f f f
        d d e e f f
        d d e e f f

Parameter names are HF's (`model.visual.` stripped): patch_embed.proj, blocks.{i}.{norm1,norm2,
attn.qkv,attn.proj,mlp.*}, merger.{ln_q,mlp.0,mlp.2}; the gated MLP's gate|up load merged.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.model_executor.layers.activation import GatedMLP
from deepinfer.model_executor.layers.norm import RMSNorm

_NORM_EPS = 1e-6  # HF's vision norms


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)  # [..., I]


_ACTS = {"quick_gelu": quick_gelu, "silu": F.silu, "gelu": F.gelu,
         "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh")}


def activation(name: str):
    """The vision config's `hidden_act` as a function (ValueError naming it when unknown)."""
    if name not in _ACTS:
        raise ValueError(f"vision_config.hidden_act={name!r} is not supported; known: {sorted(_ACTS)}")
    return _ACTS[name]


def gated(name: str):
    """[gate | up] -> act(gate) * up, for GatedMLP."""
    act = activation(name)

    def act_and_mul(x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)  # [N, I] each
        return act(gate) * up  # [N, I]
    return act_and_mul


# ---- index arithmetic over grids (pure functions of grid_thw) ------------------------------------
def cu_seqlens_of(grid_thw: torch.Tensor) -> list[int]:
    """Segment bounds: one segment per frame of each picture (h*w rows each), from 0."""
    bounds = [0]
    for t, h, w in grid_thw.tolist():
        for _ in range(t):
            bounds.append(bounds[-1] + h * w)
    return bounds


def patch_hw(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(row, col) of every patch in the processor's order (merge x merge groups contiguous) [N, 2]."""
    out = []
    for t, h, w in grid_thw.tolist():
        rows = torch.arange(h).view(h // merge, merge, 1, 1).expand(-1, -1, w // merge, merge)  # [H', m, W', m]
        cols = torch.arange(w).view(1, 1, w // merge, merge).expand(h // merge, merge, -1, -1)  # [H', m, W', m]
        hw = torch.stack([rows.transpose(1, 2).flatten(), cols.transpose(1, 2).flatten()], dim=-1)  # [h*w, 2]
        out.append(hw.repeat(t, 1))  # [t*h*w, 2]
    return torch.cat(out)  # [N, 2]


def window_order(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, list[int]]:
    """(merged-group order that makes windows contiguous [N/merge^2], window bounds in patch rows).

    `window`: merged groups on a window's side; windows tile each frame from its top-left corner,
    the last row and column of windows cut short by the frame's edge."""
    order, bounds, first = [], [0], 0
    unit = merge * merge
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        ids = torch.arange(t * gh * gw).view(t, gh, gw) + first  # [t, H', W']
        for f in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    piece = ids[f, r:r + window, c:c + window].flatten()  # [<= window^2]
                    order.append(piece)
                    bounds.append(bounds[-1] + piece.numel() * unit)
        first += t * gh * gw
    return torch.cat(order), bounds


# ---- modules ------------------------------------------------------------------------------------
class PatchEmbed(nn.Module):
    """`proj`: HF's Conv3d weight [E, C, tp, p, p] (no bias), applied as the linear map it is."""

    def __init__(self, vcfg, embed_dim: int):
        super().__init__()
        p, tp = vcfg.patch_size, vcfg.temporal_patch_size
        self.proj = nn.Module()
        self.proj.weight = nn.Parameter(torch.empty(embed_dim, vcfg.in_channels, tp, p, p))

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        w = self.proj.weight
        return F.linear(pixels.to(w.dtype), w.view(w.shape[0], -1))  # [N, E]


class VisionRotary(nn.Module):
    """2D RoPE: a head's first half rotates by the patch row, its second half by the column
    (each over head_dim/4 frequencies), rotate-half layout as in HF's vision attention. The
    frequencies are computed in fp32 at each call: a buffer would follow the model to bf16, whose
    rounding of a frequency turns into a large angle error at a far patch."""

    def __init__(self, head_dim: int, theta: float):
        super().__init__()
        self.half, self.theta = head_dim // 2, theta

    def forward(self, hw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        exponent = torch.arange(0, self.half, 2, dtype=torch.float, device=hw.device) / self.half  # [D/4]
        inv_freq = 1.0 / self.theta**exponent  # [D/4]
        freqs = hw.float()[..., None] * inv_freq  # [N, 2, D/4]
        freqs = freqs.flatten(1)  # [N, D/2]: rows' frequencies, then columns'
        emb = torch.cat((freqs, freqs), dim=-1)  # [N, D]
        return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [N, H, D] rotated in fp32 by cos, sin [N, D]; back in x's dtype."""
    xf = x.float()
    x1, x2 = xf.chunk(2, dim=-1)  # [N, H, D/2] each
    out = xf * cos[:, None] + torch.cat((-x2, x1), dim=-1) * sin[:, None]  # [N, H, D]
    return out.to(x.dtype)


def segment_index(bounds: list[int], device) -> list[torch.Tensor]:
    """The segments [bounds[i], bounds[i+1]) grouped by length: one row index [S, L] per length L
    (S segments of that length), so attention runs one batch per distinct length."""
    by_length: dict[int, list[int]] = {}
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        if b > a:
            by_length.setdefault(b - a, []).append(a)
    return [(torch.tensor(starts)[:, None] + torch.arange(length)).to(device)  # [S, L]
            for length, starts in by_length.items()]


class VisionAttention(nn.Module):
    """Bidirectional attention inside each segment (`segment_index`); `qkv` and `proj` with biases."""

    def __init__(self, dim: int, num_heads: int):
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        n = x.shape[0]
        q, k, v = self.qkv(x).view(n, 3, self.num_heads, self.head_dim).unbind(1)  # [N, H, D] each
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        out = torch.empty_like(q)  # [N, H, D]
        for index in segments:
            qs, ks, vs = (t[index].transpose(1, 2) for t in (q, k, v))  # [S, H, L, D] each
            out[index] = F.scaled_dot_product_attention(qs, ks, vs).transpose(1, 2)  # [S, L, H, D]
        return self.proj(out.reshape(n, -1))  # [N, E]


class VisionMLP(nn.Module):
    """Qwen2-VL's fc1 -> act -> fc2 (with biases)."""

    def __init__(self, dim: int, hidden: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, hidden), nn.Linear(hidden, dim), activation(act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # [N, E]


class VisionBlock(nn.Module):
    def __init__(self, dim: int, num_heads: int, norm, mlp: nn.Module):
        super().__init__()
        self.norm1, self.norm2 = norm(dim), norm(dim)
        self.attn = VisionAttention(dim, num_heads)
        self.mlp = mlp

    def forward(self, x: torch.Tensor, segments: list[torch.Tensor], cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), segments, cos, sin)  # [N, E]
        return x + self.mlp(self.norm2(x))  # [N, E]


class PatchMerger(nn.Module):
    """ln_q, then each merge x merge group's rows side by side -> Linear, exact GELU, Linear."""

    def __init__(self, dim: int, out_dim: int, merge: int, norm):
        super().__init__()
        self.width = dim * merge * merge
        self.ln_q = norm(dim)
        self.mlp = nn.Sequential(nn.Linear(self.width, self.width), nn.GELU(), nn.Linear(self.width, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.width))  # [N/merge^2, out]


def _layer_norm(dim: int) -> nn.LayerNorm:
    return nn.LayerNorm(dim, eps=_NORM_EPS)


def _rms_norm(dim: int) -> RMSNorm:
    return RMSNorm(dim, _NORM_EPS)


def _rope_theta(vcfg) -> float:
    """The vision config's RoPE theta (transformers' axial default 10000)."""
    return float((HFConfigFields.of(vcfg).rope_parameters or {}).get("rope_theta", 10000.0))


class Qwen2VisionTower(nn.Module):
    """Qwen2-VL: `embed_dim` wide blocks, merged into the language model's `hidden_size`."""

    def __init__(self, vcfg):
        super().__init__()
        dim, self.merge = vcfg.embed_dim, vcfg.spatial_merge_size
        self.patch_embed = PatchEmbed(vcfg, dim)
        self.rotary_pos_emb = VisionRotary(dim // vcfg.num_heads, _rope_theta(vcfg))
        hidden = int(dim * vcfg.mlp_ratio)
        self.blocks = nn.ModuleList(
            VisionBlock(dim, vcfg.num_heads, _layer_norm, VisionMLP(dim, hidden, vcfg.hidden_act))
            for _ in range(vcfg.depth))
        self.merger = PatchMerger(dim, vcfg.hidden_size, self.merge, _layer_norm)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixels [N, C*tp*p*p], grid_thw [P, 3] -> [N / merge^2, hidden] in the pictures' order."""
        x = self.patch_embed(pixels)  # [N, E]
        cos, sin = self.rotary_pos_emb(patch_hw(grid_thw, self.merge).to(pixels.device))  # [N, D] each
        segments = segment_index(cu_seqlens_of(grid_thw), x.device)
        for block in self.blocks:
            x = block(x, segments, cos, sin)  # [N, E]
        return self.merger(x)  # [N/4, hidden]


class Qwen25VisionTower(nn.Module):
    """Qwen2.5-VL: RMSNorm, gated MLP, window attention but in `fullatt_block_indexes`; `out_hidden_size`."""

    def __init__(self, vcfg):
        super().__init__()
        dim, self.merge = vcfg.hidden_size, vcfg.spatial_merge_size
        self.window = vcfg.window_size // vcfg.spatial_merge_size // vcfg.patch_size
        if self.window <= 0:
            raise ValueError(f"vision_config.window_size={vcfg.window_size} must be at least "
                             f"patch_size * spatial_merge_size = {vcfg.patch_size * self.merge}")
        self.full_blocks = frozenset(vcfg.fullatt_block_indexes)
        self.patch_embed = PatchEmbed(vcfg, dim)
        self.rotary_pos_emb = VisionRotary(dim // vcfg.num_heads, _rope_theta(vcfg))
        self.blocks = nn.ModuleList(
            VisionBlock(dim, vcfg.num_heads, _rms_norm,
                        GatedMLP(dim, vcfg.intermediate_size, gated(vcfg.hidden_act), bias=True, split=False))
            for _ in range(vcfg.depth))
        self.merger = PatchMerger(dim, vcfg.out_hidden_size, self.merge, _rms_norm)

    def forward(self, pixels: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixels [N, C*tp*p*p], grid_thw [P, 3] -> [N / merge^2, out_hidden] in the pictures' order."""
        unit = self.merge * self.merge
        order, window_bounds = window_order(grid_thw, self.merge, self.window)  # [N/4]
        rows = (order[:, None] * unit + torch.arange(unit)).flatten().to(pixels.device)  # [N] patch rows, window order
        x = self.patch_embed(pixels)[rows]  # [N, E]
        cos, sin = self.rotary_pos_emb(patch_hw(grid_thw, self.merge).to(pixels.device)[rows])  # [N, D] each
        full = segment_index(cu_seqlens_of(grid_thw), x.device)  # pictures stay contiguous in window order
        windows = segment_index(window_bounds, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, full if i in self.full_blocks else windows, cos, sin)  # [N, E]
        merged = self.merger(x)  # [N/4, out] in window order
        return merged[torch.argsort(order.to(merged.device))]  # [N/4, out] in the pictures' order
