"""LLaVA-NeXT (HF `llava_next`: a CLIP tower) and LLaVA-OneVision (HF `llava_onevision`: a SigLIP
tower, a Qwen2 decoder): LLaVA's projector and language model (models/llava.py) reading a picture at
any resolution ("anyres") as a base view plus a grid of tiles.

    the processor: the grid (rows x cols tiles of S x S pixels) is the `image_grid_pinpoints`
        entry that keeps most of the picture's pixels (then wastes least); the picture is resized
        into it keeping its aspect, centred on padding, and cut into tiles; a base view is the
        whole picture resized to S x S. pixel_values [1 + rows*cols, 3, S, S], image_sizes [h, w]
    tower + projector per view (as LLaVA)                                       [V, g*g, hidden]
    base view's rows                                                            [g*g, hidden]
    tiles' rows laid out as one feature map                                     [hidden, rows*g, cols*g]
        cut back to the picture's aspect (the padding rows / columns dropped)   [hidden, R, C]
        OneVision "anyres_max_m": when R*C > 1.21 * m*g*g, bilinear-scaled by
        r = sqrt(R*C / (m*g*g)) to int(R // r) x int(C // r)
        `image_newline` appended to each row, then read row by row           [R*(C+1), hidden]
    a picture's rows = base rows, then the tiles' rows: as many as the processor's placeholders.

Checkpoint names: those of models/llava.py, plus `image_newline` (`model.image_newline` in the
newer layout); a tower's `vision_tower.vision_model.*` is read as `vision_tower.*`.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.models.gemma3_vision import SiglipEmbeddings, SiglipEncoderLayer
from deepinfer.model_executor.models.llava import LlavaConfigFields, LlavaForConditionalGeneration


@dataclass(frozen=True)
class LlavaNextConfigFields(LlavaConfigFields):
    """The optional fields of a LLaVA-NeXT config (transformers' `LlavaNextConfig` defaults; its
    `image_grid_pinpoints` is always set once transformers built the config)."""

    image_grid_pinpoints: list | None = None


@dataclass(frozen=True)
class LlavaOnevisionConfigFields(LlavaNextConfigFields):
    """The optional fields of a LLaVA-OneVision config (transformers' `LlavaOnevisionConfig` defaults)."""

    image_token_index: int = 151646
    vision_feature_layer: int | list[int] = -1
    vision_feature_select_strategy: str = "full"
    vision_aspect_ratio: str = "anyres_max_9"


def max_views(vision_aspect_ratio: str) -> int:
    """m of "anyres_max_m" (ValueError naming the field otherwise)."""
    match = re.fullmatch(r"anyres_max_(\d+)", vision_aspect_ratio or "")
    if match is None:
        raise ValueError(f"vision_aspect_ratio={vision_aspect_ratio!r} is not supported; expected 'anyres_max_<n>'")
    return int(match.group(1))


def best_grid(height: int, width: int, pinpoints: list, tile: int) -> tuple[int, int]:
    """The tiles (rows, cols) of the pinpoint resolution [h, w] that shows most of a height x width
    picture resized into it keeping its aspect, ties to the one that wastes fewest pixels."""
    best, best_shown, best_waste = None, 0, math.inf
    for res_h, res_w in pinpoints:
        scale = min(res_w / width, res_h / height)
        shown_w, shown_h = int(width * scale), int(height * scale)
        shown = min(shown_w * shown_h, width * height)
        waste = res_w * res_h - shown
        if shown > best_shown or (shown == best_shown and waste < best_waste):
            best, best_shown, best_waste = (res_h, res_w), shown, waste
    if best is None:
        raise ValueError(f"image_grid_pinpoints={pinpoints!r} has no resolution for a {height}x{width} picture")
    return best[0] // tile, best[1] // tile


def unpad(grid: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """grid [hidden, R, C] of a height x width picture centred on padding -> the rows and columns
    that show the picture [hidden, R', C'] (the processor's padding split evenly both sides)."""
    _, rows, cols = grid.shape
    if width / height > cols / rows:  # wider than the grid: padding above and below
        shown = int(round(height * (cols / width), 7))
        pad = (rows - shown) // 2
        return grid[:, pad:rows - pad]  # [hidden, R', C]
    shown = int(round(width * (rows / height), 7))
    pad = (cols - shown) // 2
    return grid[:, :, pad:cols - pad]  # [hidden, R, C']


class SiglipFeatureTower(nn.Module):
    """SigLIP's vision transformer (gemma3_vision's layers) giving the hidden states at
    `feature_layers` (HF's `hidden_states` indices: 0 is the embeddings' output; no post-layernorm,
    which only HF's last_hidden_state has); only the layers needed are kept."""

    def __init__(self, cfg, feature_layers: tuple[int, ...]):
        super().__init__()
        total = cfg.num_hidden_layers
        self.feature_layers = tuple(i % (total + 1) for i in feature_layers)  # non-negative
        self.image_size = cfg.image_size
        self.embeddings = SiglipEmbeddings(cfg)
        self.encoder = nn.Module()
        self.encoder.layers = nn.ModuleList(SiglipEncoderLayer(cfg) for _ in range(max(self.feature_layers)))

    def forward(self, pixel_values: torch.Tensor) -> list[torch.Tensor]:
        """pixel_values [n, 3, S, S] -> the chosen hidden states, each [n, N, Hv]."""
        size = tuple(pixel_values.shape[-2:])
        if size != (self.image_size, self.image_size):
            raise ValueError(f"pixel_values: views of {size[0]}x{size[1]} pixels; this vision tower "
                             f"takes {self.image_size}x{self.image_size}")
        h = self.embeddings(pixel_values)  # [n, N, Hv]
        states = [h]
        for layer in self.encoder.layers:
            h = layer(h)  # [n, N, Hv]
            states.append(h)
        return [states[i] for i in self.feature_layers]


class LlavaNextForConditionalGeneration(LlavaForConditionalGeneration):
    """HF `llava_next`: LLaVA with anyres pictures (module docstring); `encode_pictures` reads each
    picture's `pixel_values` ([1, P, 3, S, S] or [P, 3, S, S], P >= 1 + the grid's tiles; views past
    them are the processor's batch padding) and `image_sizes` ([1, 2] or [2]: height, width)."""

    fields_class = LlavaNextConfigFields

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        super().__init__(cfg, max_positions, expert_parallel_size)
        fields = self.fields_class.of(cfg)
        if not fields.image_grid_pinpoints:
            raise ValueError(f"image_grid_pinpoints={fields.image_grid_pinpoints!r}: the config names no grid")
        vision = cfg.vision_config
        self.pinpoints = [tuple(int(v) for v in p) for p in fields.image_grid_pinpoints]
        self.tile, self.side = vision.image_size, vision.image_size // vision.patch_size
        self.max_rows = None  # LLaVA-NeXT keeps every unpadded row
        self.image_newline = nn.Parameter(torch.zeros(cfg.text_config.hidden_size))

    # ---- pictures ------------------------------------------------------------------------------
    def encode_pictures(self, pictures: list) -> list[torch.Tensor]:
        """Each picture's rows [length, hidden]: all pictures' views through the tower and the
        projector in one batch, then each picture's packed (module docstring)."""
        weight = self.multi_modal_projector.linear_1.weight
        device, dtype = weight.device, weight.dtype
        views, sizes = [], []
        for i, picture in enumerate(pictures):
            pixels, size = self._views(i, picture)
            views.append(pixels.to(device=device, dtype=dtype))
            sizes.append(size)
        states = self.vision_tower(torch.cat(views))  # k x [V, N(+1), Hv]
        if self.drop_cls:
            states = [s[:, 1:] for s in states]  # k x [V, N, Hv]
        features = self.multi_modal_projector(torch.cat(states, dim=-1))  # [V, g*g, hidden]
        if features.shape[1] != self.side * self.side:
            raise ValueError(f"the tower gives {features.shape[1]} rows a view where the anyres grid needs "
                             f"{self.side}x{self.side} (vision_feature_select_strategy drops a row the tower lacks?)")
        per_picture = features.split([v.shape[0] for v in views])  # [V_k, g*g, hidden] each
        return [self._pack(f, size) for f, size in zip(per_picture, sizes, strict=True)]

    def _views(self, i: int, picture) -> tuple[torch.Tensor, tuple[int, int]]:
        """picture i's base view and tiles [1 + rows*cols, 3, S, S], and its (height, width)."""
        for key in ("pixel_values", "image_sizes"):
            if key not in picture.tensors:
                raise ValueError(f"pictures[{i}].tensors lacks {key!r}; has {sorted(picture.tensors)}")
        size = torch.as_tensor(picture.tensors["image_sizes"]).reshape(-1).tolist()
        if len(size) != 2 or min(size) <= 0:
            raise ValueError(f"pictures[{i}].tensors['image_sizes'] must be one (height, width), got {size}")
        height, width = int(size[0]), int(size[1])
        rows, cols = best_grid(height, width, self.pinpoints, self.tile)
        pixels = torch.as_tensor(picture.tensors["pixel_values"])
        if pixels.dim() == 5 and pixels.shape[0] == 1:
            pixels = pixels[0]  # [P, 3, S, S]
        needed = 1 + rows * cols
        if pixels.dim() != 4 or pixels.shape[0] < needed:
            raise ValueError(f"pictures[{i}].tensors['pixel_values'] has shape {tuple(pixels.shape)}; a "
                             f"{height}x{width} picture needs [{needed}, 3, S, S] (base view + {rows}x{cols} tiles)")
        return pixels[:needed], (height, width)

    def _pack(self, features: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        """features [1 + rows*cols, g*g, hidden] of one picture -> its rows [length, hidden]."""
        height, width = size
        rows, cols = best_grid(height, width, self.pinpoints, self.tile)
        g, hidden = self.side, features.shape[-1]
        base = features[0]  # [g*g, hidden]
        tiles = features[1:].view(rows, cols, g, g, hidden)  # [rows, cols, g, g, hidden]
        grid = tiles.permute(4, 0, 2, 1, 3).reshape(hidden, rows * g, cols * g)  # [hidden, R, C]
        grid = self._limit(unpad(grid, height, width))  # [hidden, R', C']
        newline = self.image_newline.to(grid.dtype)[:, None, None].expand(hidden, grid.shape[1], 1)  # [hidden, R', 1]
        lines = torch.cat([grid, newline], dim=2)  # [hidden, R', C' + 1]
        return torch.cat([base, lines.flatten(1).transpose(0, 1)])  # [g*g + R'*(C'+1), hidden]

    def _limit(self, grid: torch.Tensor) -> torch.Tensor:
        """LLaVA-NeXT: the grid as it is (OneVision overrides: the anyres_max bound)."""
        return grid

    def _our_names(self, weights):
        """LLaVA's names, with `model.image_newline` and a tower's `vision_model.` level read as
        ours; SigLIP's pooling head (unused) is left out."""
        return super()._our_names(_tower_level_dropped(weights))


def _tower_level_dropped(weights):
    for name, tensor in weights:
        for theirs, ours in _RENAMES:
            if name.startswith(theirs):
                name = ours + name[len(theirs):]
                break
        if not name.startswith(_UNUSED):
            yield name, tensor


# checkpoint prefix -> the prefix models/llava.py reads (first match wins)
_RENAMES = (("model.image_newline", "image_newline"),
            ("model.vision_tower.vision_model.", "vision_tower."),
            ("vision_tower.vision_model.", "vision_tower."))
_UNUSED = ("vision_tower.head.", "model.vision_tower.head.")


class LlavaOnevisionForConditionalGeneration(LlavaNextForConditionalGeneration):
    """HF `llava_onevision`: LLaVA-NeXT's packing over a SigLIP tower, the unpadded grid scaled down
    when it holds more than `vision_aspect_ratio`'s m views of rows (module docstring). Pictures only
    (the checkpoint's video path is not served)."""

    fields_class = LlavaOnevisionConfigFields

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        super().__init__(cfg, max_positions, expert_parallel_size)
        self.max_views = max_views(LlavaOnevisionConfigFields.of(cfg).vision_aspect_ratio)

    @staticmethod
    def build_vision_tower(vision_cfg, feature_layers: tuple[int, ...]) -> nn.Module:
        return SiglipFeatureTower(vision_cfg, feature_layers)

    def _limit(self, grid: torch.Tensor) -> torch.Tensor:
        """grid [hidden, R, C] -> itself, or bilinear-scaled to int(R // r) x int(C // r) when
        r = sqrt(R*C / (m*g*g)) exceeds 1.1."""
        _, rows, cols = grid.shape
        ratio = math.sqrt(rows * cols / (self.max_views * self.side**2))
        if ratio <= 1.1:
            return grid
        scaled = F.interpolate(grid[None], [int(rows // ratio), int(cols // ratio)], mode="bilinear")  # [1, h, r, c]
        return scaled[0]  # [hidden, R'', C'']
