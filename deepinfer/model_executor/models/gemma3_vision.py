"""Gemma 3 with pictures (HF `Gemma3ForConditionalGeneration`, model_type `gemma3`): a SigLIP vision
tower, Gemma 3's multi-modal projector, and the text decoder of models/gemma3.py.

    picture  pixel_values [1, 3, S, S]
    tower    patches = conv(S/p x S/p grid, stride p) + learned position  [N = (S/p)^2, Hv]
             layer: x + attn(layer_norm1(x)); x + fc2(gelu_tanh(fc1(layer_norm2(x))))  (full, no mask)
             post_layernorm                                                  [N, Hv]
    project  avg-pool the patch grid to sqrt(m) x sqrt(m) cells (m = mm_tokens_per_image)  [m, Hv]
             RMSNorm (1 + w), times mm_input_projection_weight               [m, hidden]
    decoder  the picture's m rows replace its placeholder run's token embeddings after the
             sqrt(hidden) scale (the picture's rows are not scaled)

Attention over a picture's run: HF lets the tokens of one run see each other both ways in the
prefill (token_type_ids -> a blockwise mask OR-ed with the causal one; sliding layers keep their
lower bound p - W + 1). Here `forward` sets `AttentionMetadata.horizons` from the picture rows
(ops/addressing.py `run_horizons`): a query of a run sees up to the run's last position. The run's
later keys are rows of the same chunk, so the whole run must be in one prefill chunk (a run cut by
a chunk boundary is seen whole only within each piece). Decoding is causal, as in HF.

Checkpoint names: `model.language_model.*` / `language_model.model.*` (the decoder), `model.vision_tower.*`
/ `vision_tower.[vision_model.]*`, `model.multi_modal_projector.*`; the head is tied to the embedding.
SigLIP's pooling head (`vision_tower.head.*`, present when `vision_use_head`) is unused and skipped.
As HF's class, the logits are not soft-capped even when text_config names final_logit_softcapping.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.contracts.multimodal import PictureInput
from deepinfer.model_executor.forward_context import get_forward_context
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.ops.addressing import run_horizons
from deepinfer.model_executor.models.gemma3 import GEMMA_NORM_OFFSET, Gemma3ForCausalLM

_GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")
# checkpoint prefix -> our prefix (first match wins: the longer forms come first)
_RENAMES = (
    ("model.language_model.", "model."),
    ("language_model.model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("model.vision_tower.vision_model.", "vision_tower."),
    ("vision_tower.vision_model.", "vision_tower."),
    ("model.vision_tower.", "vision_tower."),
    ("model.multi_modal_projector.", "multi_modal_projector."),
)
_UNUSED = ("vision_tower.head.",)  # SigLIP's attention-pooling head


def check_vision_config(vcfg, mm_tokens_per_image: int) -> None:
    """Refuse a vision config this tower does not implement, naming the field and value."""
    if vcfg.hidden_act not in _GELU_TANH:
        raise ValueError(f"vision_config.hidden_act={vcfg.hidden_act!r} is not supported; expected gelu_pytorch_tanh")
    if vcfg.image_size % vcfg.patch_size:
        raise ValueError(f"vision_config.image_size={vcfg.image_size} must be a multiple of "
                         f"vision_config.patch_size={vcfg.patch_size}")
    side, cells = vcfg.image_size // vcfg.patch_size, round(mm_tokens_per_image**0.5)
    if cells * cells != mm_tokens_per_image or side % cells:
        raise ValueError(f"mm_tokens_per_image={mm_tokens_per_image} must be a square whose side divides the "
                         f"patch grid side {side} (image_size / patch_size)")
    if vcfg.hidden_size % vcfg.num_attention_heads:
        raise ValueError(f"vision_config.num_attention_heads={vcfg.num_attention_heads} must divide "
                         f"vision_config.hidden_size={vcfg.hidden_size}")


class SiglipEmbeddings(nn.Module):
    """HF names `patch_embedding` (conv, stride = patch) and `position_embedding` (one per patch)."""

    def __init__(self, vcfg):
        super().__init__()
        self.patch_embedding = nn.Conv2d(vcfg.num_channels, vcfg.hidden_size, vcfg.patch_size, vcfg.patch_size)
        self.num_patches = (vcfg.image_size // vcfg.patch_size) ** 2
        self.position_embedding = nn.Embedding(self.num_patches, vcfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        """pixel_values [B, C, S, S] -> [B, N, Hv], N patches in row-major grid order."""
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [B, Hv, S/p, S/p]
        return patches.flatten(2).transpose(1, 2) + self.position_embedding.weight  # [B, N, Hv]


class SiglipAttention(nn.Module):
    """Full bidirectional attention over one picture's patches; q|k|v merged (models/utils.py loads
    HF's `q_proj`, `k_proj`, `v_proj` into `qkv_proj`), `out_proj`."""

    def __init__(self, vcfg):
        super().__init__()
        hidden = vcfg.hidden_size
        self.num_heads, self.head_dim = vcfg.num_attention_heads, hidden // vcfg.num_attention_heads
        self.qkv_proj = nn.Linear(hidden, 3 * hidden)
        self.qkv_proj.shard_sizes = [hidden] * 3
        self.out_proj = nn.Linear(hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, N, _ = x.shape
        q, k, v = (t.view(B, N, self.num_heads, self.head_dim).transpose(1, 2)
                   for t in self.qkv_proj(x).chunk(3, dim=-1))  # [B, h, N, d] each
        out = F.scaled_dot_product_attention(q, k, v, scale=self.head_dim**-0.5)  # [B, h, N, d]
        return self.out_proj(out.transpose(1, 2).reshape(B, N, -1))  # [B, N, Hv]


class SiglipMLP(nn.Module):
    def __init__(self, vcfg):
        super().__init__()
        self.fc1 = nn.Linear(vcfg.hidden_size, vcfg.intermediate_size)
        self.fc2 = nn.Linear(vcfg.intermediate_size, vcfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))  # [B, N, Hv]


class SiglipEncoderLayer(nn.Module):
    """Pre-norm: x + attn(layer_norm1(x)), then x + mlp(layer_norm2(x))."""

    def __init__(self, vcfg):
        super().__init__()
        self.layer_norm1 = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)
        self.self_attn = SiglipAttention(vcfg)
        self.layer_norm2 = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)
        self.mlp = SiglipMLP(vcfg)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(self.layer_norm1(x))  # [B, N, Hv]
        return x + self.mlp(self.layer_norm2(x))  # [B, N, Hv]


class SiglipEncoder(nn.Module):
    def __init__(self, vcfg):
        super().__init__()
        self.layers = nn.ModuleList(SiglipEncoderLayer(vcfg) for _ in range(vcfg.num_hidden_layers))


class SiglipVisionTower(nn.Module):
    """HF `SiglipVisionModel` without its pooling head: pixels [B, C, S, S] -> [B, N, Hv]."""

    def __init__(self, vcfg):
        super().__init__()
        self.embeddings = SiglipEmbeddings(vcfg)
        self.encoder = SiglipEncoder(vcfg)
        self.post_layernorm = nn.LayerNorm(vcfg.hidden_size, eps=vcfg.layer_norm_eps)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        x = self.embeddings(pixel_values)  # [B, N, Hv]
        for layer in self.encoder.layers:
            x = layer(x)
        return self.post_layernorm(x)  # [B, N, Hv]


class Gemma3Projector(nn.Module):
    """HF `Gemma3MultiModalProjector`: patch grid avg-pooled to m cells, RMSNorm (1 + w), projected."""

    def __init__(self, vcfg, text_hidden: int, mm_tokens_per_image: int):
        super().__init__()
        self.side = vcfg.image_size // vcfg.patch_size  # patches per grid side
        self.kernel = self.side // round(mm_tokens_per_image**0.5)
        self.mm_soft_emb_norm = RMSNorm(vcfg.hidden_size, vcfg.layer_norm_eps, GEMMA_NORM_OFFSET)
        self.mm_input_projection_weight = nn.Parameter(torch.zeros(vcfg.hidden_size, text_hidden))

    def forward(self, patches: torch.Tensor) -> torch.Tensor:
        """patches [B, N, Hv] -> [B, m, hidden]."""
        B, _, Hv = patches.shape
        grid = patches.transpose(1, 2).reshape(B, Hv, self.side, self.side)  # [B, Hv, side, side]
        cells = F.avg_pool2d(grid, self.kernel, self.kernel).flatten(2).transpose(1, 2)  # [B, m, Hv]
        return self.mm_soft_emb_norm(cells) @ self.mm_input_projection_weight  # [B, m, hidden]


class Gemma3ForConditionalGeneration(Gemma3ForCausalLM):
    """HF `gemma3`: Gemma 3's decoder (config.text_config) reading pictures through the SigLIP tower
    (config.vision_config) and the projector. `encode_pictures` gives each picture's rows;
    `forward(..., picture_rows=(rows, embeds))` puts them in place and lets each run see itself whole."""

    # the decoder's, less tensor parallelism and load-time quantization (the tower is neither split
    # nor quantized); decode reads no picture and stays graph-safe
    capabilities = ModelCapabilities(graph_safe_decode=True, native_batch_invariant=True, pictures=True,
                                     whole_picture_runs=True)

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        self.mm_tokens_per_image = int(cfg.mm_tokens_per_image)
        check_vision_config(cfg.vision_config, self.mm_tokens_per_image)
        super().__init__(cfg.text_config, max_positions, expert_parallel_size)
        self.multimodal_config = cfg
        self.vision_tower = SiglipVisionTower(cfg.vision_config)
        self.multi_modal_projector = Gemma3Projector(cfg.vision_config, cfg.text_config.hidden_size,
                                                     self.mm_tokens_per_image)
        self.image_size = cfg.vision_config.image_size

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1):
        """Gemma 3's decoder spec, without the final logit soft-cap: HF's Gemma3ForConditionalGeneration
        applies none, whatever text_config.final_logit_softcapping says (real checkpoints set None)."""
        return replace(super().decoder_spec(cfg, expert_parallel_size), final_softcap=None)

    def encode_pictures(self, pictures: Sequence[PictureInput]) -> list[torch.Tensor]:
        """Each picture's rows [mm_tokens_per_image, hidden], in order (one tower call for all)."""
        if not pictures:
            return []
        pixels = torch.cat([self._pixels(i, p) for i, p in enumerate(pictures)])  # [n, C, S, S]
        weight = self.multi_modal_projector.mm_input_projection_weight
        rows = self.multi_modal_projector(self.vision_tower(pixels.to(weight.device, weight.dtype)))  # [n, m, hidden]
        return list(rows.unbind(0))

    def _pixels(self, i: int, picture: PictureInput) -> torch.Tensor:
        """picture i's pixel_values as [1, C, S, S] (ValueError naming the field otherwise)."""
        if picture.length != self.mm_tokens_per_image:
            raise ValueError(f"pictures[{i}].length={picture.length}: this model gives each picture "
                             f"mm_tokens_per_image={self.mm_tokens_per_image} rows")
        if "pixel_values" not in picture.tensors:
            raise ValueError(f"pictures[{i}].tensors has no 'pixel_values' (keys: {sorted(picture.tensors)})")
        pixels = torch.as_tensor(picture.tensors["pixel_values"])
        pixels = pixels.unsqueeze(0) if pixels.dim() == 3 else pixels
        S = self.image_size
        if pixels.dim() != 4 or pixels.shape[0] != 1 or tuple(pixels.shape[2:]) != (S, S):
            raise ValueError(f"pictures[{i}].tensors['pixel_values'] has shape {tuple(pixels.shape)}; "
                             f"expected [1, C, {S}, {S}]")
        return pixels

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, picture_rows=None) -> torch.Tensor:
        """input_ids, positions [T] -> hidden [T, hidden]; picture_rows (rows [P], embeds [P, hidden]),
        sorted by row, replace those rows' embeddings, and each run of them is seen whole."""
        if picture_rows is None:
            return self.model(input_ids, positions)  # [T, hidden]
        rows, embeds = picture_rows
        ids = input_ids.index_fill(0, rows, 0)  # [T]: a placeholder id may lie past the vocabulary (HF: pad)
        md = get_forward_context().attn_metadata
        breaks = torch.tensor([span.token_start for span in md.spans], dtype=torch.long, device=rows.device)
        md.horizons = run_horizons(md.positions, rows, breaks)  # [T]
        try:
            return self.model(ids, positions, (rows, embeds))  # [T, hidden]
        finally:
            md.horizons = None

    def load_weights(self, weights) -> None:
        """HF `Gemma3ForConditionalGeneration` names, mapped onto ours (module docstring)."""
        super().load_weights((name, tensor) for name, tensor in map(_renamed, weights)
                             if not name.startswith(_UNUSED))


def _renamed(item: tuple[str, torch.Tensor]) -> tuple[str, torch.Tensor]:
    name, tensor = item
    for theirs, ours in _RENAMES:
        if name.startswith(theirs):
            return ours + name[len(theirs):], tensor
    return name, tensor
