"""A vision checkpoint's picture preprocessing: its processor's arrays and the prompt's placeholder runs.

    chat template with {"type": "image"} parts -> text with one marker per picture
    image processor (the checkpoint's preprocessor_config.json, PIL backend) -> arrays for all pictures
    each marker replaced by the picture's placeholder text, as the HF processor does -> tokenized
    -> per picture: PictureInput(content hash, offset and length of its run, its own arrays)

The per-family knowledge is the table `FAMILIES` (model_type -> markers, placeholder token, how many
placeholders a picture takes, how the processor's arrays split per picture); nothing else here knows
a family. The counts are computed the way the HF processors' `replace_image_token` computes them
(`tests/serving/test_vision.py` checks ids and arrays against the processors themselves).
The image processor is loaded with transformers' PIL backend (torchvision is not needed).
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from deepinfer.contracts.multimodal import PictureInput, check_pictures
from deepinfer.serving.errors import FieldError
from deepinfer.serving.pictures import Picture


def _split_stacked(arrays: dict, counts: list[int], cfg: dict) -> list[dict]:
    """pixel_values [n, 3, H, W] (one row per picture) -> one [1, 3, H, W] per picture."""
    return [{"pixel_values": arrays["pixel_values"][k:k + 1]} for k in range(len(counts))]


def _split_patches(arrays: dict, counts: list[int], cfg: dict) -> list[dict]:
    """Qwen2-VL: pixel_values [sum t*h*w, C*...] (patches of all pictures, in order) and
    image_grid_thw [n, 3] -> each picture's patch rows and its grid row."""
    grids = arrays["image_grid_thw"]
    ends = np.cumsum([int(np.prod(g)) for g in grids])
    starts = np.concatenate([[0], ends[:-1]])
    return [{"pixel_values": arrays["pixel_values"][s:e], "image_grid_thw": grids[k:k + 1]}
            for k, (s, e) in enumerate(zip(starts, ends, strict=True))]


@dataclass(frozen=True)
class Family:
    """How one model family writes pictures into its prompt.

    marker: what the chat template writes for a picture (and what the processor replaces);
    placeholder: the token whose rows the encoder output fills (its run is the PictureInput's);
    num_tokens(arrays, k, cfg): placeholder tokens of picture k;
    replacement(cfg, n): the text a marker becomes for a picture of n placeholders;
    split(arrays, counts, cfg): the processor's arrays -> one dict per picture."""

    marker: Callable[[dict], str]
    placeholder: Callable[[dict], str]
    num_tokens: Callable[[dict, int, dict], int]
    replacement: Callable[[dict, int], str]
    split: Callable[[dict, list[int], dict], list[dict]]


def _llava_tokens(arrays: dict, k: int, cfg: dict) -> int:
    height, width = arrays["pixel_values"].shape[-2:]
    patch = cfg["patch_size"]
    n = (height // patch) * (width // patch) + cfg.get("num_additional_image_tokens", 0)
    return n - 1 if cfg.get("vision_feature_select_strategy", "default") == "default" else n


def _qwen_tokens(arrays: dict, k: int, cfg: dict) -> int:
    return int(np.prod(arrays["image_grid_thw"][k])) // (cfg.get("merge_size", 2) ** 2)


def _best_resolution(height: int, width: int, pinpoints: list) -> tuple[int, int]:
    """The `image_grid_pinpoints` entry (h, w) the anyres processors pick: the one showing most of the
    picture resized into it keeping its aspect, ties to the one wasting fewest pixels."""
    best, best_shown, best_waste = None, 0, float("inf")
    for res_h, res_w in pinpoints:
        scale = min(res_w / width, res_h / height)
        shown = min(int(width * scale) * int(height * scale), width * height)
        waste = res_w * res_h - shown
        if shown > best_shown or (shown == best_shown and waste < best_waste):
            best, best_shown, best_waste = (int(res_h), int(res_w)), shown, waste
    if best is None:
        raise FieldError("messages", f"a {height}x{width} picture fits none of image_grid_pinpoints={pinpoints!r}")
    return best


def _anyres_views(arrays: dict, k: int, cfg: dict) -> tuple[int, int, int, int]:
    """Picture k's (height, width) and its grid of tiles (rows, cols), as the anyres processor cut it."""
    height, width = (int(v) for v in arrays["image_sizes"][k])
    tile_h, tile_w = arrays["pixel_values"].shape[-2:]
    best_h, best_w = _best_resolution(height, width, cfg["image_grid_pinpoints"])
    return height, width, best_h // tile_h, best_w // tile_w


def _anyres_tokens(arrays: dict, k: int, cfg: dict, side: int, base: int, max_views: int | None) -> int:
    """Placeholders of an anyres picture (LLaVA-NeXT / OneVision processors' count): `base` rows of the
    base view, then the tiles' grid of `side` x `side` rows each, cut to the picture's aspect, scaled
    down past `max_views` views' worth, plus one newline row per grid row."""
    height, width, rows, cols = _anyres_views(arrays, k, cfg)
    grid_h, grid_w = side * rows, side * cols
    if width / height > grid_w / grid_h:
        shown = int(round(height * (grid_w / width), 7))
        grid_h -= (grid_h - shown) // 2 * 2
    else:
        shown = int(round(width * (grid_h / height), 7))
        grid_w -= (grid_w - shown) // 2 * 2
    if max_views is not None:
        ratio = math.sqrt(grid_h * grid_w / (max_views * side * side))
        if ratio > 1.1:
            grid_h, grid_w = int(grid_h // ratio), int(grid_w // ratio)
    n = base + grid_h * grid_w + grid_h
    return n - 1 if cfg.get("vision_feature_select_strategy", "default") == "default" else n


def _llava_next_tokens(arrays: dict, k: int, cfg: dict) -> int:
    side = arrays["pixel_values"].shape[-2] // cfg["patch_size"]
    return _anyres_tokens(arrays, k, cfg, side, side * side + cfg.get("num_additional_image_tokens", 0), None)


def _onevision_tokens(arrays: dict, k: int, cfg: dict) -> int:
    per_view = cfg.get("num_image_tokens") or (arrays["pixel_values"].shape[-2] // cfg["patch_size"]) ** 2
    match = re.fullmatch(r"anyres_max_(\d+)", cfg.get("vision_aspect_ratio", "anyres_max_9"))
    if match is None:
        raise FieldError("model", f"vision_aspect_ratio={cfg.get('vision_aspect_ratio')!r} is not 'anyres_max_<n>'")
    return _anyres_tokens(arrays, k, cfg, math.isqrt(per_view), per_view, int(match.group(1)))


def _split_anyres(arrays: dict, counts: list[int], cfg: dict) -> list[dict]:
    """pixel_values [n, P_max, 3, S, S] (views padded to the batch's most) and image_sizes [n, 2] ->
    each picture's own views [1, 1 + rows*cols, 3, S, S] and its size [1, 2]."""
    out = []
    for k in range(len(counts)):
        _, _, rows, cols = _anyres_views(arrays, k, cfg)
        out.append({"pixel_values": arrays["pixel_values"][k:k + 1, :1 + rows * cols],
                    "image_sizes": arrays["image_sizes"][k:k + 1]})
    return out


_LLAVA = Family(marker=lambda c: c.get("image_token", "<image>"), placeholder=lambda c: c.get("image_token", "<image>"),
                num_tokens=_llava_tokens, replacement=lambda c, n: c.get("image_token", "<image>") * n,
                split=_split_stacked)
_QWEN2_VL = Family(marker=lambda c: "<|image_pad|>", placeholder=lambda c: "<|image_pad|>",
                   num_tokens=_qwen_tokens, replacement=lambda c, n: "<|image_pad|>" * n, split=_split_patches)
_GEMMA3 = Family(marker=lambda c: c["boi_token"], placeholder=lambda c: c["image_token"],
                 num_tokens=lambda a, k, c: c.get("image_seq_length", 256),
                 replacement=lambda c, n: f"\n\n{c['boi_token']}{c['image_token'] * n}{c['eoi_token']}\n\n",
                 split=_split_stacked)
_LLAVA_NEXT = Family(marker=_LLAVA.marker, placeholder=_LLAVA.placeholder, num_tokens=_llava_next_tokens,
                     replacement=_LLAVA.replacement, split=_split_anyres)
_LLAVA_ONEVISION = Family(marker=_LLAVA.marker, placeholder=_LLAVA.placeholder, num_tokens=_onevision_tokens,
                          replacement=_LLAVA.replacement, split=_split_anyres)
FAMILIES: dict[str, Family] = {"llava": _LLAVA, "llava_next": _LLAVA_NEXT, "llava_onevision": _LLAVA_ONEVISION,
                               "qwen2_vl": _QWEN2_VL, "qwen2_5_vl": _QWEN2_VL, "gemma3": _GEMMA3}


class VisionProcessor:
    """A checkpoint's picture preprocessing (module docstring); `load` gives None for a text model."""

    def __init__(self, model_type: str, image_processor, cfg: dict):
        self.model_type, self.family = model_type, FAMILIES[model_type]
        self.image_processor, self.cfg = image_processor, cfg

    @classmethod
    def load(cls, model_dir: str, tokenizer=None) -> VisionProcessor | None:
        """The folder's processor, or None when the model has no vision encoder we serve."""
        config = _read_json(os.path.join(model_dir, "config.json"))
        model_type = config.get("model_type")
        if model_type not in FAMILIES or "vision_config" not in config:
            return None
        from transformers import AutoImageProcessor

        image_processor = AutoImageProcessor.from_pretrained(model_dir, backend="pil")
        return cls(model_type, image_processor, _family_settings(model_dir, config, image_processor, tokenizer))

    @classmethod
    def from_mmproj(cls, vision: dict) -> VisionProcessor:
        """The preprocessing of a GGUF language model with llama.cpp's vision file (`--mmproj`), which
        ships no preprocessor_config.json: built from the mmproj's keys (`ModelSource.vision`)."""
        model_type = vision["model_type"]
        picture = vision["picture"]
        settings = {**_MMPROJ_SETTINGS[model_type], **picture}
        return cls(model_type, _mmproj_image_processor(model_type, picture), settings)

    def process(self, tokenizer, text: str, pictures: Sequence[Picture],
                add_special_tokens: bool = False) -> tuple[list[int], tuple[PictureInput, ...]]:
        """The prompt ids with every picture's marker expanded, and each picture's PictureInput.
        FieldError when the template wrote a marker count other than the pictures' count."""
        marker, n = self.family.marker(self.cfg), len(pictures)
        pieces = text.split(marker)
        if len(pieces) - 1 != n:
            raise FieldError("messages", f"the prompt holds {len(pieces) - 1} picture markers ({marker!r}) for {n} "
                             f"pictures (a marker in the text, or a chat template that writes no pictures)")
        arrays = dict(self.image_processor(images=[p.image for p in pictures], return_tensors="np"))
        counts = [self.family.num_tokens(arrays, k, self.cfg) for k in range(n)]
        expanded = pieces[0] + "".join(self.family.replacement(self.cfg, c) + rest
                                       for c, rest in zip(counts, pieces[1:], strict=True))
        ids = list(tokenizer(expanded, add_special_tokens=add_special_tokens)["input_ids"])
        offsets = _runs(ids, tokenizer.convert_tokens_to_ids(self.family.placeholder(self.cfg)), counts)
        inputs = tuple(PictureInput(p.content_hash, offset, count, tensors)
                       for p, offset, count, tensors in zip(pictures, offsets, counts,
                                                            self.family.split(arrays, counts, self.cfg), strict=True))
        check_pictures(inputs, len(ids))
        return ids, inputs


def _runs(ids: list[int], token_id: int, counts: list[int]) -> list[int]:
    """Each picture's run start: the placeholder positions taken in order, `counts[k]` for picture k."""
    positions = [i for i, t in enumerate(ids) if t == token_id]
    if len(positions) != sum(counts):
        raise FieldError("messages", f"the prompt holds {len(positions)} picture placeholder tokens where its "
                         f"{len(counts)} pictures need {sum(counts)} (a placeholder token in the text?)")
    offsets, taken = [], 0
    for count in counts:
        run = positions[taken:taken + count]
        if run[-1] - run[0] != count - 1:
            raise FieldError("messages", "a picture's placeholder tokens are not contiguous in the prompt")
        offsets.append(run[0])
        taken += count
    return offsets


def _family_settings(model_dir: str, config: dict, image_processor, tokenizer) -> dict:
    """The processor's settings (processor_config.json, else config.json), plus the tokens a family names."""
    cfg = {k: v for k, v in _read_json(os.path.join(model_dir, "processor_config.json")).items()
           if not isinstance(v, dict)}
    vision = config.get("vision_config") or {}
    cfg.setdefault("patch_size", vision.get("patch_size", 14))
    cfg.setdefault("vision_feature_select_strategy", config.get("vision_feature_select_strategy", "default"))
    cfg.setdefault("image_seq_length", config.get("mm_tokens_per_image", 256))
    cfg["merge_size"] = getattr(image_processor, "merge_size", None) or 2
    cfg.setdefault("vision_aspect_ratio", config.get("vision_aspect_ratio", "anyres_max_9"))
    if getattr(image_processor, "image_grid_pinpoints", None):  # anyres (LLaVA-NeXT, OneVision)
        cfg["image_grid_pinpoints"] = image_processor.image_grid_pinpoints
    for name, default in (("boi_token", "<start_of_image>"), ("eoi_token", "<end_of_image>"),
                          ("image_token", "<image_soft_token>" if config.get("model_type") == "gemma3" else None)):
        value = getattr(tokenizer, name, None) if tokenizer is not None else None
        if isinstance(value, str):
            cfg.setdefault(name, value)
        elif default is not None:
            cfg.setdefault(name, default)
    return cfg


def _read_json(path: str) -> dict:
    if not os.path.exists(path):
        return {}
    with open(path, encoding="utf-8") as f:
        return json.load(f)


# ---- a GGUF language model with llama.cpp's vision file (--mmproj): no preprocessor_config.json --------
# the tokens each family's prompts use (llama.cpp's mtmd writes the same), beside the mmproj's own numbers
_MMPROJ_SETTINGS = {
    "gemma3": {"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>", "image_token": "<image_soft_token>"},
    "llava": {"image_token": "<image>", "num_additional_image_tokens": 1, "vision_feature_select_strategy": "default"},
    "qwen2_vl": {},
    "qwen2_5_vl": {},
}


def _mmproj_image_processor(model_type: str, picture: dict):
    """The transformers image processor (PIL backend) the family's checkpoint would ship, set from the
    mmproj's image size, mean, std and patch / merge sizes."""
    import transformers

    norm = {"image_mean": picture["image_mean"], "image_std": picture["image_std"]}
    if model_type == "gemma3":
        size = picture["image_size"]
        return transformers.Gemma3ImageProcessorPil(size={"height": size, "width": size}, **norm)
    if model_type == "llava":
        size = picture["image_size"]
        square = {"height": size, "width": size}
        return transformers.CLIPImageProcessorPil(size={"shortest_edge": size}, crop_size=square, **norm)
    bounds = {}
    if "min_pixels" in picture and "max_pixels" in picture:
        bounds["size"] = {"shortest_edge": picture["min_pixels"], "longest_edge": picture["max_pixels"]}
    return transformers.Qwen2VLImageProcessorPil(patch_size=picture["patch_size"], merge_size=picture["merge_size"],
                                                 temporal_patch_size=picture["temporal_patch_size"], **norm, **bounds)
