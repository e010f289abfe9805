"""Qwen2-VL and Qwen2.5-VL: a Qwen2 decoder with M-RoPE that reads pictures through a vision tower.

    encode_pictures(pictures)        each picture's pixel_values, image_grid_thw -> [length, hidden]
    rope_positions(pictures, s, n)   a request's M-RoPE positions [3, n] of token indices s .. s+n-1
    forward(ids, positions, picture_rows=None, rope_positions=None)
        h = embed(ids), rows picture_rows[0] replaced by picture_rows[1]                [T, hidden]
        the decoder (models/decoder.py, `llama_spec` with q|k|v biases) at rope_positions [3, T]
        (M-RoPE), or at positions [T] when no request of the step has a picture

The config is transformers' composite one: `text_config` (the decoder), `vision_config` (the tower)
and, at the top, `tie_word_embeddings` and the placeholder ids. Checkpoints written by
transformers >= 5 name the decoder `model.language_model.*` and the tower `model.visual.*`; older
ones `model.*` and `visual.*`; both load (here the decoder is `model`, the tower `visual`).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.model import ModelCapabilities
from deepinfer.model_executor.layers.rotary import rope_inv_freq
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec
from deepinfer.model_executor.models.llama import LlamaConfigFields, llama_spec
from deepinfer.model_executor.models.qwen2_vl.mrope import MRotaryEmbedding, PictureGrid, mrope_positions
from deepinfer.model_executor.models.qwen2_vl.vision import Qwen2VisionTower, Qwen25VisionTower

_RENAMES = (("model.language_model.", "model."), ("model.visual.", "visual."))


def mrope_rotary(spec: DecoderSpec, cfg, max_positions: int) -> list[MRotaryEmbedding]:
    """One M-RoPE table for every layer (the text config's rope parameters and `mrope_section`)."""
    inv_freq, scaling = rope_inv_freq(cfg, spec.head_dim)
    section = (HFConfigFields.of(cfg).rope_parameters or {}).get("mrope_section")
    if section is None:
        raise ValueError("text_config.rope_parameters.mrope_section is missing (M-RoPE needs the 3 section sizes)")
    return [MRotaryEmbedding(inv_freq, max_positions, section, scaling)] * cfg.num_hidden_layers


def _as_tensor(value, name: str, index: int) -> torch.Tensor:
    if value is None:
        raise ValueError(f"pictures[{index}].tensors[{name!r}] is missing")
    return torch.as_tensor(value)


class Qwen2VLForConditionalGeneration(DecoderLM):
    """HF `qwen2_vl`: the Qwen2 decoder, M-RoPE, the Qwen2-VL vision tower (`visual`)."""

    # pictures change the embeddings and the rope positions of a request on every step, so decode
    # does not replay as a CUDA graph; the vision tower is held whole (no tensor parallelism yet);
    # its RoPE positions are its own (M-RoPE: worker/rope_positions.py asks `rope_positions`)
    capabilities = ModelCapabilities(pictures=True, rope_positions=True)
    tower = Qwen2VisionTower

    def __init__(self, cfg, max_positions: int = 0, expert_parallel_size: int = 1):
        text = cfg.text_config
        # the head's tie is a top-level field; the decoder reads it from the config it builds from
        text.tie_word_embeddings = bool(LlamaConfigFields.of(cfg).tie_word_embeddings)
        super().__init__(text, max_positions, expert_parallel_size)
        self.merge = cfg.vision_config.spatial_merge_size
        self.visual = self.tower(cfg.vision_config)

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return llama_spec(cfg, qkv_bias=True, rotaries=mrope_rotary)

    # ---- pictures ---------------------------------------------------------------------------
    def picture_grid(self, picture, index: int = 0) -> PictureGrid:
        """A picture's run and merged grid, checked against its placeholder count."""
        t, h, w = (int(v) for v in _as_tensor(picture.tensors.get("image_grid_thw"), "image_grid_thw", index)
                   .reshape(-1)[:3].tolist())
        grid = PictureGrid(picture.offset, t, h // self.merge, w // self.merge)
        if grid.length != picture.length or h % self.merge or w % self.merge:
            raise ValueError(f"pictures[{index}]: image_grid_thw ({t}, {h}, {w}) gives {grid.length} tokens after "
                             f"the {self.merge}x{self.merge} merge, but its run has length {picture.length}")
        return grid

    def rope_positions(self, pictures: Sequence, start: int, count: int) -> torch.Tensor:
        """M-RoPE positions [3, count] of one request's token indices start .. start+count-1."""
        grids = [self.picture_grid(p, i) for i, p in enumerate(pictures)]
        return mrope_positions(grids, start, count)  # [3, count]

    @torch.no_grad()
    def encode_pictures(self, pictures: Sequence) -> list[torch.Tensor]:
        """Each picture's rows [p.length, hidden], all pictures through the tower at once (attention
        never crosses pictures, so a picture's rows do not depend on the others)."""
        if not pictures:
            return []
        grids = [self.picture_grid(p, i) for i, p in enumerate(pictures)]
        weight = self.visual.patch_embed.proj.weight
        pixels = torch.cat([_as_tensor(p.tensors.get("pixel_values"), "pixel_values", i)
                            for i, p in enumerate(pictures)]).to(weight.device, weight.dtype)  # [N, C*tp*p*p]
        grid_thw = torch.cat([_as_tensor(p.tensors["image_grid_thw"], "image_grid_thw", i).reshape(1, 3)
                              for i, p in enumerate(pictures)]).long()  # [P, 3]
        out = self.visual(pixels, grid_thw)  # [sum of lengths, hidden]
        return list(out.split([g.length for g in grids]))

    # ---- forward ----------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, picture_rows=None,
                rope_positions: torch.Tensor | None = None) -> torch.Tensor:
        """ids [T], positions [T]; picture_rows (rows [P], embeds [P, hidden]); rope_positions [3, T]."""
        rope = positions if rope_positions is None else rope_positions  # [T] or [3, T]
        return self.model(input_ids, rope, picture_rows)  # [T, hidden]

    def load_weights(self, weights: Iterable) -> None:
        super().load_weights((_renamed(name), tensor) for name, tensor in weights)


def _renamed(name: str) -> str:
    for old, new in _RENAMES:
        if name.startswith(old):
            return new + name[len(old):]
    return name


class Qwen2_5_VLForConditionalGeneration(Qwen2VLForConditionalGeneration):  # noqa: N801 (HF's name)
    """HF `qwen2_5_vl`: as Qwen2-VL, with the windowed Qwen2.5-VL vision tower."""

    tower = Qwen25VisionTower
