"""LLaVA (HF `llava`, the LLaVA-1.5 layout): a CLIP vision tower, a two-layer projector and a
language model of one of our decoder families, built from the config's `text_config`.

    pixel_values [n, 3, S, S] --patch conv + CLS + positions, pre-layernorm-->   [n, 1 + N, Hv]
        CLIP encoder layers up to `vision_feature_layer` (an index into the hidden states:
        0 = the pre-layernorm's output, -1 = the last layer's; a list concatenates several)
        "default" drops the CLS row, "full" keeps it                          [n, N or 1 + N, Hv·k]
    projector: linear_2(act(linear_1(x)))                                      [n, N, hidden]
    each picture's rows replace its placeholder run's token embeddings (`picture_rows`), then the
    language model runs as for text.

The tower keeps only the layers the chosen hidden states need (the last one, and the post-layernorm,
are unused for the default -2). Parameter names follow HF checkpoints saved by
`LlavaForConditionalGeneration` (`language_model.model.*`, `language_model.lm_head`, `vision_tower.*`,
`multi_modal_projector.*`); the newer layout (`model.language_model.*`, `model.vision_tower.*`,
`lm_head`) is renamed as it is read. CLIP's q/k/v load into one merged `qkv_proj`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.model import ModelCapabilities, NoRequestState
from deepinfer.model_executor.models.registry import get_model_class
from deepinfer.model_executor.models.utils import load_weights


def quick_gelu(x: torch.Tensor) -> torch.Tensor:
    return x * torch.sigmoid(1.702 * x)


_ACTIVATIONS = {
    "quick_gelu": quick_gelu,
    "gelu": F.gelu,
    "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "silu": F.silu,
    "relu": F.relu,
}


def activation(name: str, field: str):
    """The activation called `name` (HF's spelling); ValueError naming `field` for another."""
    if name not in _ACTIVATIONS:
        raise ValueError(f"{field}={name!r} is not supported; supported: {', '.join(sorted(_ACTIVATIONS))}")
    return _ACTIVATIONS[name]


@dataclass(frozen=True)
class LlavaConfigFields(HFConfigFields):
    """The optional fields of a LLaVA config (transformers' `LlavaConfig` defaults)."""

    image_token_index: int = 32000
    vision_feature_layer: int | list[int] = -2
    vision_feature_select_strategy: str = "default"
    projector_hidden_act: str = "gelu"
    multimodal_projector_bias: bool = True


@dataclass(frozen=True)
class ClipVisionFields(HFConfigFields):
    """The optional fields of the `vision_config` the tower reads (transformers' `CLIPVisionConfig`)."""

    hidden_act: str = "quick_gelu"
    layer_norm_eps: float = 1e-5
    num_channels: int = 3


class ClipAttention(nn.Module):
    """Bidirectional multi-head attention over one picture's patches (q|k|v merged)."""

    def __init__(self, cfg):
        super().__init__()
        self.num_heads, self.head_dim = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
        self.qkv_proj = nn.Linear(cfg.hidden_size, 3 * cfg.hidden_size)
        self.qkv_proj.shard_sizes = [cfg.hidden_size] * 3  # HF q_proj | k_proj | v_proj load here
        self.out_proj = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        n, L, _ = x.shape
        qkv = self.qkv_proj(x).view(n, L, 3, self.num_heads, self.head_dim)  # [n, L, 3, H, D]
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # [n, H, L, D] each
        out = F.scaled_dot_product_attention(q, k, v)  # [n, H, L, D]
        return self.out_proj(out.transpose(1, 2).reshape(n, L, -1))  # [n, L, Hv]


class ClipMLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.act = activation(ClipVisionFields.of(cfg).hidden_act, "vision_config.hidden_act")
        self.fc1 = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.fc2 = nn.Linear(cfg.intermediate_size, cfg.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc1(x)))  # [n, L, Hv]


class ClipEncoderLayer(nn.Module):
    """Pre-layernorm transformer layer: h + attn(ln1(h)), then + mlp(ln2(h))."""

    def __init__(self, cfg):
        super().__init__()
        eps = ClipVisionFields.of(cfg).layer_norm_eps
        self.layer_norm1 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.self_attn = ClipAttention(cfg)
        self.layer_norm2 = nn.LayerNorm(cfg.hidden_size, eps=eps)
        self.mlp = ClipMLP(cfg)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        h = h + self.self_attn(self.layer_norm1(h))  # [n, L, Hv]
        return h + self.mlp(self.layer_norm2(h))  # [n, L, Hv]


class ClipEmbeddings(nn.Module):
    """Patch convolution (no bias), a learned CLS row in front, learned absolute positions."""

    def __init__(self, cfg):
        super().__init__()
        self.image_size, self.patch_size = cfg.image_size, cfg.patch_size
        self.patch_embedding = nn.Conv2d(ClipVisionFields.of(cfg).num_channels, cfg.hidden_size, cfg.patch_size,
                                         stride=cfg.patch_size, bias=False)
        self.class_embedding = nn.Parameter(torch.empty(cfg.hidden_size))
        self.position_embedding = nn.Embedding((cfg.image_size // cfg.patch_size) ** 2 + 1, cfg.hidden_size)

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        size = tuple(pixel_values.shape[-2:])
        if size != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values: pictures of {size[0]}x{size[1]} pixels; this vision tower "
                             f"takes {self.image_size}x{self.image_size} (resize with the model's processor)")
        patches = self.patch_embedding(pixel_values.to(self.patch_embedding.weight.dtype))  # [n, Hv, g, g]
        patches = patches.flatten(2).transpose(1, 2)  # [n, N, Hv]
        cls = self.class_embedding.expand(patches.shape[0], 1, -1)  # [n, 1, Hv]
        return torch.cat([cls, patches], dim=1) + self.position_embedding.weight  # [n, 1 + N, Hv]


class ClipVisionTower(nn.Module):
    """CLIP's vision transformer up to its last needed layer: the hidden states at `feature_layers`
    (indices as HF's `hidden_states` tuple: 0 is the pre-layernorm output)."""

    def __init__(self, cfg, feature_layers: tuple[int, ...]):
        super().__init__()
        total = cfg.num_hidden_layers
        self.feature_layers = tuple(i % (total + 1) for i in feature_layers)  # non-negative
        self.embeddings = ClipEmbeddings(cfg)
        self.pre_layrnorm = nn.LayerNorm(cfg.hidden_size, eps=ClipVisionFields.of(cfg).layer_norm_eps)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(ClipEncoderLayer(cfg) for _ in range(max(self.feature_layers)))

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, 3, S, S] -> the chosen hidden states, each [n, 1 + N, Hv]."""
        h = self.pre_layrnorm(self.embeddings(pixel_values))  # [n, 1 + N, Hv]
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)  # [n, 1 + N, Hv]
            states.append(h)
        return [states[i] for i in self.feature_layers]


class LlavaProjector(nn.Module):
    """linear_2(act(linear_1(x))): vision features to the language model's hidden size."""

    def __init__(self, vision_width: int, hidden_size: int, act: str, bias: bool):
        super().__init__()
        self.linear_1 = nn.Linear(vision_width, hidden_size, bias=bias)
        self.act = activation(act, "projector_hidden_act")
        self.linear_2 = nn.Linear(hidden_size, hidden_size, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_2(self.act(self.linear_1(x)))  # [n, N, hidden]


class LlavaForConditionalGeneration(NoRequestState, nn.Module):
    """HF `llava`: pictures through the CLIP tower and the projector into the language model's
    rows (`encode_pictures`, `forward(..., picture_rows=)`); caches, logits and decoding are the
    language model's (any family of ours, from `text_config.model_type`)."""

    # a `PictureModel`; its decode steps are the language model's, but the vision tower is not split
    # over ranks nor quantized, and encoding batches pictures: nothing else is claimed
    capabilities = ModelCapabilities(pictures=True)
    fields_class = LlavaConfigFields  # the config's optional fields and their defaults

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        super().__init__()
        fields = self.fields_class.of(cfg)
        self.config, self.fields = cfg, fields
        layers = fields.vision_feature_layer
        layers = tuple(layers) if isinstance(layers, (list, tuple)) else (layers,)
        strategy = fields.vision_feature_select_strategy
        if strategy not in ("default", "full"):
            raise ValueError(f"vision_feature_select_strategy={strategy!r} is not supported; use 'default' or 'full'")
        text_cfg, vision_cfg = cfg.text_config, cfg.vision_config
        self.language_model = get_model_class(text_cfg.model_type)(text_cfg, max_positions)
        self.vision_tower = self.build_vision_tower(vision_cfg, layers)
        self.multi_modal_projector = LlavaProjector(vision_cfg.hidden_size * len(layers), text_cfg.hidden_size,
                                                    fields.projector_hidden_act, bool(fields.multimodal_projector_bias))
        self.drop_cls = strategy == "default"

    @staticmethod
    def build_vision_tower(vision_cfg, feature_layers: tuple[int, ...]) -> nn.Module:
        """The vision tower giving the hidden states at `feature_layers` (CLIP's; a family with
        another tower overrides this)."""
        return ClipVisionTower(vision_cfg, feature_layers)

    # ---- pictures (the PictureModel protocol) -------------------------------------------------
    def encode_pictures(self, pictures: list) -> list[torch.Tensor]:
        """Each picture's rows [length, hidden]: its `pixel_values` ([3, S, S] or [1, 3, S, S])
        through the tower and the projector, all pictures in one batch."""
        weight = self.multi_modal_projector.linear_1.weight
        device, dtype = weight.device, weight.dtype
        pixels = torch.cat([_pixel_values(p).to(device=device, dtype=dtype) for p in pictures])  # [n, 3, S, S]
        states = self.vision_tower(pixels)  # k x [n, 1 + N, Hv]
        if self.drop_cls:
            states = [s[:, 1:] for s in states]  # k x [n, N, Hv]
        features = self.multi_modal_projector(torch.cat(states, dim=-1))  # [n, N', hidden]
        return list(features.unbind(0))

    # ---- the CachedModel protocol: the language model's ---------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, picture_rows=None) -> torch.Tensor:
        return self.language_model(input_ids, positions, picture_rows)  # [T, hidden]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.language_model.compute_logits(hidden)  # [N, V]

    def cache_groups(self) -> list:
        return self.language_model.cache_groups()

    def bind_caches(self, caches) -> None:
        self.language_model.bind_caches(caches)

    def load_weights(self, weights: Iterable) -> None:
        skip = ("language_model.lm_head.",) if self.language_model.tie_word_embeddings else ()
        loaded = load_weights(self, self._our_names(weights), skip_prefixes=skip)
        missing = {n for n, _ in self.named_parameters()} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")

    def _our_names(self, weights: Iterable) -> Iterator:
        """The checkpoint's tensors under our names; the tower's unused layers and post-layernorm
        are left out."""
        kept = len(self.vision_tower.encoder.layers)
        for name, tensor in weights:
            name = _renamed(name)
            if name.startswith("vision_tower.post_layernorm."):
                continue
            if name.startswith("vision_tower.encoder.layers.") and int(name.split(".")[3]) >= kept:
                continue
            yield name, tensor


_NEW_LAYOUT = (("model.language_model.", "language_model.model."), ("model.vision_tower.", "vision_tower."),
               ("model.multi_modal_projector.", "multi_modal_projector."), ("lm_head.", "language_model.lm_head."))


def _renamed(name: str) -> str:
    """A checkpoint name in the layout `LlavaForConditionalGeneration.save_pretrained` writes."""
    for new, old in _NEW_LAYOUT:
        if name.startswith(new):
            return old + name[len(new):]
    return name


def _pixel_values(picture) -> torch.Tensor:
    """The picture's `pixel_values` as [1, 3, S, S] (ValueError naming the field otherwise)."""
    if "pixel_values" not in picture.tensors:
        raise ValueError(f"picture {picture.content_hash[:12]}: tensors lack 'pixel_values'; "
                         f"has {sorted(picture.tensors)}")
    pixels = torch.as_tensor(picture.tensors["pixel_values"])
    if pixels.dim() == 3:
        pixels = pixels.unsqueeze(0)  # [1, 3, S, S]
    if pixels.dim() != 4 or pixels.shape[0] != 1:
        raise ValueError(f"pixel_values of one picture must be [3, S, S] or [1, 3, S, S], got {tuple(pixels.shape)}")
    return pixels
