"""llama.cpp's vision file (`--mmproj FILE`): a GGUF of `general.architecture` "clip" holding a vision
tower and its projector, read into the HF vision config and the HF parameter names of our picture
model classes (models/gemma3_vision.py, models/qwen2_vl/, models/llava.py).

    clip.projector_type     gemma3            -> Gemma 3 (SigLIP tower, pooled soft tokens)
                            qwen2.5vl_merger  -> Qwen2.5-VL (windowed tower, 2x2 merger)
                            qwen2vl_merger    -> Qwen2-VL
                            mlp               -> LLaVA-1.5 (CLIP tower, two-layer projector)
    clip.vision.*           image_size, patch_size, embedding_length, feed_forward_length,
                            block_count, attention.head_count, attention.layer_norm_epsilon,
                            image_mean, image_std (the text model's width is read off the
                            projector's last matrix),
                            spatial_merge_size, window_size, wa_layer_indexes / n_wa_pattern,
                            projector.scale_factor (Gemma 3's pooling, 4 when absent)

Tensor names come from the `gguf` package's own tables, the ones llama.cpp's converter maps with:
each HF name of the family (as the converter sees it) goes through
`gguf.get_tensor_name_map(MODEL_ARCH.MMPROJ, blocks)`, and the table is read backwards. What the
converter does beyond a rename, undone here:

    gemma3      `mm_input_projection_weight` is written as `mm.input_projection.weight` (same
                layout [Hv, hidden]); the soft-embedding norm is stored as 1 + w
    qwen2*vl    the fused `attn.qkv` is split into attn_q | attn_k | attn_v (weights and biases);
                the Conv3d patch kernel [E, C, 2, p, p] into its two temporal halves
                `v.patch_embd.weight` (t = 0) and `v.patch_embd.weight.1` (t = 1)
    mlp         llama.cpp's legacy LLaVA converter: the projector under the original LLaVA's
                Sequential indices `mm.0` / `mm.2`, the tower's last layer and post-norm left out
                (LLaVA reads the next-to-last layer: here every stored block runs, which is HF's
                vision_feature_layer -2 on the whole tower), fc1 / fc2 sometimes written as
                ffn_down / ffn_up (told apart by shape, as llama.cpp does); LLaVA-NeXT's keys
                (image_grid_pinpoints, feature_layer) are refused

Every tensor is dequantized to float at load (`gguf.quants.dequantize` for Q8_0 and the like).
A file that is not "clip", lacks a key or a tensor, has a tensor of the wrong shape, or names an
unknown projector is refused with one line naming the file and the key or tensor.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from deepinfer.model_executor.loader.gguf_file import GGUFTensor, read_gguf_file

MMPROJ_ARCHITECTURE = "clip"
_P = "clip.vision."  # the vision keys' prefix (gguf.Keys.ClipVision)


class MmprojError(ValueError):
    """A vision file that cannot be used; the message is one line naming the file and what is wrong."""


@dataclass(frozen=True)
class TensorRule:
    """How one of our parameters is read: from which file tensors, combined how, of which shape."""

    sources: tuple[str, ...]  # GGUF tensor names
    combine: Callable[[list[torch.Tensor]], torch.Tensor]
    shape: tuple[int, ...] | None  # the torch shape our parameter has (None: not checked)


@dataclass
class Mmproj:
    """A vision file, read: its family, the HF configs it stands for, and how each parameter is read.

    `model_type`: the picture model's HF model_type; `vision_config`: the HF vision config's fields;
    `top`: the composite config's own fields (mm_tokens_per_image, vision_feature_layer, ...);
    `picture`: what the picture preprocessing needs (image size, mean, std, patch and merge size);
    `text_hidden`: the width of the rows the projector writes (the language model's hidden size);
    `rules`: our HF parameter name -> TensorRule."""

    path: str
    projector: str
    model_type: str
    vision_config: dict
    top: dict
    picture: dict
    text_hidden: int
    rules: dict[str, TensorRule] = field(default_factory=dict)
    tensors: dict[str, GGUFTensor] = field(default_factory=dict, repr=False)


def _fail(path: str, what: str) -> MmprojError:
    return MmprojError(f"mmproj file {path!r}: {what}")


def _key(path: str, metadata: dict, name: str, default: Any = ...) -> Any:
    """metadata[name]; without a default, a missing key is refused naming it."""
    if name in metadata:
        return metadata[name]
    if default is ...:
        raise _fail(path, f"metadata key {name!r} is missing")
    return default


def read_mmproj(path: str) -> Mmproj:
    """The vision file at `path`, its header and tensor table read, every tensor checked (nothing decoded)."""
    try:
        file = read_gguf_file(path)
    except (OSError, ValueError) as exc:
        reason = " ".join(str(exc).split())  # one line
        raise _fail(path, f"not a readable GGUF file ({reason})") from None
    meta = file.metadata
    arch = meta.get("general.architecture")
    if arch != MMPROJ_ARCHITECTURE:
        raise _fail(path, f"general.architecture is {arch!r}, not 'clip' (is it the language model's file?)")
    # `clip.projector_type`; files with several encoders name the vision one's `clip.vision.projector_type`
    projector = meta.get("clip.vision.projector_type") or _key(path, meta, "clip.projector_type")
    if projector not in _FAMILIES:
        raise _fail(path, f"clip.projector_type {projector!r} is not supported; supported: "
                          f"{', '.join(_FAMILIES)}")
    tensors = {t.name: t for t in file.tensors}
    mm = _FAMILIES[projector](path, meta, tensors, projector)
    mm.tensors = tensors
    _check_tensors(mm)
    return mm


def _common(path: str, meta: dict) -> dict:
    """The keys every family's tower reads."""
    return {
        "hidden": int(_key(path, meta, _P + "embedding_length")),
        "ffn": int(_key(path, meta, _P + "feed_forward_length", 0)),
        "blocks": int(_key(path, meta, _P + "block_count")),
        "heads": int(_key(path, meta, _P + "attention.head_count")),
        "patch": int(_key(path, meta, _P + "patch_size")),
        "eps": float(_key(path, meta, _P + "attention.layer_norm_epsilon", 1e-6)),
        "mean": [float(v) for v in _key(path, meta, _P + "image_mean")],
        "std": [float(v) for v in _key(path, meta, _P + "image_std")],
    }


def _out_width(path: str, tensors: dict, name: str, dim: int) -> int:
    """The language model's width the projector writes: a dimension of its last matrix (the
    projection_dim key is the text width in converted files, but CLIP's own projection size in the
    legacy LLaVA ones)."""
    return _shape_of(path, tensors, name)[dim]


def _shape_of(path: str, tensors: dict, name: str) -> tuple[int, ...]:
    if name not in tensors:
        raise _fail(path, f"tensor {name!r} is missing")
    return tuple(tensors[name].shape)


def _name_map(blocks: int):
    """The converter's HF name -> GGUF name table (`gguf.tensor_mapping`) for `blocks` layers."""
    import gguf

    # the projector's layers (`mm.{bid}`: Qwen's merger.mlp.0 / .2) share the blocks' index pattern:
    # a table of fewer than 3 blocks would not know `mm.2`
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(blocks, 3))

    def gguf_name(hf_name: str) -> str:
        name = table.get_name(hf_name, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise KeyError(f"gguf.tensor_mapping has no GGUF name for {hf_name!r}")
        return name
    return gguf_name


def _as_is(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0]


def _cat(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat(parts, dim=0)  # q | k | v rows


def _minus_one(parts: list[torch.Tensor]) -> torch.Tensor:
    return parts[0].float() - 1.0  # stored as 1 + w


def _temporal_stack(parts: list[torch.Tensor]) -> torch.Tensor:
    return torch.stack(parts, dim=2)  # 2 x [E, C, p, p] -> [E, C, 2, p, p]


def _rule(gguf_name: str, shape, combine=_as_is) -> TensorRule:
    return TensorRule((gguf_name,), combine, tuple(shape) if shape is not None else None)


# ---- Gemma 3 ------------------------------------------------------------------------------------
_SIGLIP = "vision_tower.vision_model."  # the names the converter reads (transformers 4 checkpoints)


def _siglip_layer_rules(gguf_name, i: int, hidden: int, ffn: int) -> dict[str, TensorRule]:
    """One SigLIP / CLIP encoder layer: its HF names -> rules (q, k, v, out, fc1, fc2, two norms)."""
    stem, rules = f"{_SIGLIP}encoder.layers.{i}.", {}
    shapes = {"self_attn.q_proj": (hidden, hidden), "self_attn.k_proj": (hidden, hidden),
              "self_attn.v_proj": (hidden, hidden), "self_attn.out_proj": (hidden, hidden),
              "mlp.fc1": (ffn, hidden), "mlp.fc2": (hidden, ffn), "layer_norm1": (hidden,), "layer_norm2": (hidden,)}
    for part, shape in shapes.items():
        for suffix in ("weight", "bias"):
            hf = f"{stem}{part}.{suffix}"
            rules[hf] = _rule(gguf_name(hf), shape if suffix == "weight" else shape[:1])
    return rules


def _gemma3(path: str, meta: dict, tensors: dict, projector: str) -> Mmproj:
    c = _common(path, meta)
    c["text_hidden"] = _out_width(path, tensors, "mm.input_projection.weight", 1)  # torch [Hv, hidden]
    size = int(_key(path, meta, _P + "image_size"))
    scale = int(_key(path, meta, _P + "projector.scale_factor", 4))
    side = size // c["patch"]
    if scale <= 0 or side % scale:
        raise _fail(path, f"clip.vision.projector.scale_factor {scale} does not divide the patch grid side {side}")
    ffn = c["ffn"] or _shape_of(path, tensors, "v.blk.0.ffn_up.weight")[0]
    gguf_name = _name_map(c["blocks"])
    hidden = c["hidden"]
    rules = {f"{_SIGLIP}embeddings.patch_embedding.weight": _rule(
                 gguf_name(f"{_SIGLIP}embeddings.patch_embedding.weight"), (hidden, 3, c["patch"], c["patch"])),
             f"{_SIGLIP}embeddings.patch_embedding.bias": _rule(
                 gguf_name(f"{_SIGLIP}embeddings.patch_embedding.bias"), (hidden,)),
             f"{_SIGLIP}embeddings.position_embedding.weight": _rule(
                 gguf_name(f"{_SIGLIP}embeddings.position_embedding.weight"), (side * side, hidden))}
    for i in range(c["blocks"]):
        rules.update(_siglip_layer_rules(gguf_name, i, hidden, ffn))
    for suffix in ("weight", "bias"):
        hf = f"{_SIGLIP}post_layernorm.{suffix}"
        rules[hf] = _rule(gguf_name(hf), (hidden,))
    rules["multi_modal_projector.mm_soft_emb_norm.weight"] = _rule(
        gguf_name("multi_modal_projector.mm_soft_emb_norm.weight"), (hidden,), _minus_one)
    # the converter renames `_weight` to `.weight` before mapping
    rules["multi_modal_projector.mm_input_projection_weight"] = _rule(
        gguf_name("multi_modal_projector.mm_input_projection.weight"), (hidden, c["text_hidden"]))
    vision = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=c["blocks"],
                  num_attention_heads=c["heads"], image_size=size, patch_size=c["patch"], layer_norm_eps=c["eps"],
                  hidden_act="gelu_pytorch_tanh", num_channels=3, vision_use_head=False)
    cells = side // scale
    return Mmproj(path, projector, "gemma3", vision, {"mm_tokens_per_image": cells * cells},
                  {"image_size": size, "image_mean": c["mean"], "image_std": c["std"],
                   "image_seq_length": cells * cells}, c["text_hidden"], rules)


# ---- Qwen2-VL / Qwen2.5-VL ----------------------------------------------------------------------
def _qwen_rules(path: str, tensors: dict, c: dict, ffn: int, gated: bool, merge: int) -> dict[str, TensorRule]:
    """The Qwen2(.5)-VL tower's HF names (`visual.*`) -> rules: the qkv split and the Conv3d halves undone."""
    gguf_name = _name_map(c["blocks"])
    E, p, width = c["hidden"], c["patch"], c["hidden"] * merge * merge
    patch = gguf_name("visual.patch_embed.proj.weight")
    rules = {"visual.patch_embed.proj.weight": TensorRule((patch, patch + ".1"), _temporal_stack, (E, 3, 2, p, p))}
    mlp = ({"gate_proj": (ffn, E), "up_proj": (ffn, E), "down_proj": (E, ffn)} if gated
           else {"fc1": (ffn, E), "fc2": (E, ffn)})
    for i in range(c["blocks"]):
        stem = f"visual.blocks.{i}."
        for suffix in ("weight", "bias"):
            parts = tuple(gguf_name(f"{stem}attn.{x}.{suffix}") for x in "qkv")  # converter: qkv -> q, k, v
            rules[f"{stem}attn.qkv.{suffix}"] = TensorRule(parts, _cat, (3 * E, E) if suffix == "weight" else (3 * E,))
            rules[f"{stem}attn.proj.{suffix}"] = _rule(gguf_name(f"{stem}attn.proj.{suffix}"),
                                                      (E, E) if suffix == "weight" else (E,))
            for part, shape in mlp.items():
                rules[f"{stem}mlp.{part}.{suffix}"] = _rule(gguf_name(f"{stem}mlp.{part}.{suffix}"),
                                                           shape if suffix == "weight" else shape[:1])
        for norm in ("norm1", "norm2"):
            for suffix in ("weight",) if gated else ("weight", "bias"):  # Qwen2.5-VL: RMSNorm
                rules[f"{stem}{norm}.{suffix}"] = _rule(gguf_name(f"{stem}{norm}.{suffix}"), (E,))
    for suffix in ("weight",) if gated else ("weight", "bias"):
        rules[f"visual.merger.ln_q.{suffix}"] = _rule(gguf_name(f"visual.merger.ln_q.{suffix}"), (E,))
    for k, shape in (("0", (width, width)), ("2", (c["text_hidden"], width))):
        for suffix in ("weight", "bias"):
            rules[f"visual.merger.mlp.{k}.{suffix}"] = _rule(gguf_name(f"visual.merger.mlp.{k}.{suffix}"),
                                                            shape if suffix == "weight" else shape[:1])
    return rules


def _qwen_vl(path: str, meta: dict, tensors: dict, projector: str) -> Mmproj:
    c = _common(path, meta)
    c["text_hidden"] = _out_width(path, tensors, "mm.2.weight", 0)  # torch [hidden, width]
    gated = projector == "qwen2.5vl_merger"
    merge = int(_key(path, meta, _P + "spatial_merge_size", 2))
    up = "v.blk.0.ffn_gate.weight" if gated else "v.blk.0.ffn_up.weight"
    ffn = _shape_of(path, tensors, up)[0]  # Qwen2-VL's feed_forward_length key is not the MLP's width
    common = dict(depth=c["blocks"], num_heads=c["heads"], patch_size=c["patch"], spatial_merge_size=merge,
                  temporal_patch_size=2, in_channels=3)
    if gated:
        full = _key(path, meta, _P + "wa_layer_indexes", None)
        if full is None:
            period = int(_key(path, meta, _P + "n_wa_pattern"))
            full = [i for i in range(c["blocks"]) if (i + 1) % period == 0]
        vision = dict(common, hidden_size=c["hidden"], intermediate_size=ffn, out_hidden_size=c["text_hidden"],
                      hidden_act="silu", window_size=int(_key(path, meta, _P + "window_size", 112)),
                      fullatt_block_indexes=[int(i) for i in full])
        model_type = "qwen2_5_vl"
    else:
        if ffn % c["hidden"]:
            raise _fail(path, f"tensor 'v.blk.0.ffn_up.weight' is {ffn} wide, not a multiple of "
                              f"clip.vision.embedding_length {c['hidden']} (Qwen2-VL's mlp_ratio)")
        vision = dict(common, embed_dim=c["hidden"], hidden_size=c["text_hidden"], mlp_ratio=ffn // c["hidden"],
                      hidden_act="quick_gelu")
        model_type = "qwen2_vl"
    picture = {"patch_size": c["patch"], "merge_size": merge, "temporal_patch_size": 2,
               "image_mean": c["mean"], "image_std": c["std"]}
    for key, name in (("image_min_pixels", "min_pixels"), ("image_max_pixels", "max_pixels")):
        if _P + key in meta:
            picture[name] = int(meta[_P + key])
    return Mmproj(path, projector, model_type, vision, {}, picture, c["text_hidden"],
                  _qwen_rules(path, tensors, c, ffn, gated, merge))


# ---- LLaVA-1.5 ----------------------------------------------------------------------------------
def _llava(path: str, meta: dict, tensors: dict, projector: str) -> Mmproj:
    import gguf

    for key in (_P + "image_grid_pinpoints", _P + "feature_layer"):  # LLaVA-NeXT's tiles, multi-layer features
        if key in meta:
            raise _fail(path, f"metadata key {key!r} is set (LLaVA-NeXT); only LLaVA-1.5's 'mlp' files are supported")
    c = _common(path, meta)
    c["text_hidden"] = _out_width(path, tensors, "mm.2.weight", 0)  # torch [hidden, hidden]
    size, hidden = int(_key(path, meta, _P + "image_size")), c["hidden"]
    ffn = c["ffn"] or max(_shape_of(path, tensors, "v.blk.0.ffn_up.weight"))
    gguf_name = _name_map(c["blocks"])
    ours = "vision_tower."  # our tower's names (transformers 5's layout: no `vision_model.`)
    rules = {}
    cls = gguf_name(f"{_SIGLIP}embeddings.class_embedding")
    rules[f"{ours}embeddings.class_embedding"] = TensorRule(
        (cls if cls in tensors else cls + ".weight",), _as_is, (hidden,))
    rules[f"{ours}embeddings.patch_embedding.weight"] = _rule(
        gguf_name(f"{_SIGLIP}embeddings.patch_embedding.weight"), (hidden, 3, c["patch"], c["patch"]))
    rules[f"{ours}embeddings.position_embedding.weight"] = _rule(
        gguf_name(f"{_SIGLIP}embeddings.position_embedding.weight"), ((size // c["patch"]) ** 2 + 1, hidden))
    for suffix in ("weight", "bias"):
        rules[f"{ours}pre_layrnorm.{suffix}"] = _rule(gguf_name(f"{_SIGLIP}pre_layrnorm.{suffix}"), (hidden,))
    for i in range(c["blocks"]):
        for hf, rule in _siglip_layer_rules(gguf_name, i, hidden, ffn).items():
            rules[ours + hf[len(_SIGLIP):]] = rule
    _unswap_ffn(rules, tensors, c["blocks"], hidden)
    mm = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_MMPROJ]  # "mm.{bid}": LLaVA's mm_projector.0 and .2
    w0 = _shape_of(path, tensors, mm.format(bid=0) + ".weight")
    bias = mm.format(bid=0) + ".bias" in tensors
    for ours_name, bid, shape in (("linear_1", 0, (c["text_hidden"], hidden)),
                                  ("linear_2", 2, (c["text_hidden"], c["text_hidden"]))):
        for suffix in ("weight", "bias") if bias else ("weight",):
            rules[f"multi_modal_projector.{ours_name}.{suffix}"] = _rule(
                f"{mm.format(bid=bid)}.{suffix}", shape if suffix == "weight" else shape[:1])
    if w0[1] != hidden:
        raise _fail(path, f"tensor 'mm.0.weight' has shape {list(w0)}, expected [*, {hidden}] "
                          f"(clip.vision.embedding_length)")
    vision = dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=c["blocks"],
                  num_attention_heads=c["heads"], image_size=size, patch_size=c["patch"], layer_norm_eps=c["eps"],
                  hidden_act="gelu" if meta.get("clip.use_gelu") else "quick_gelu", num_channels=3)
    top = {"vision_feature_layer": -1, "vision_feature_select_strategy": "default", "projector_hidden_act": "gelu",
           "multimodal_projector_bias": bias}
    return Mmproj(path, projector, "llava", vision, top,
                  {"image_size": size, "patch_size": c["patch"], "image_mean": c["mean"], "image_std": c["std"]},
                  c["text_hidden"], rules)


def _unswap_ffn(rules: dict, tensors: dict, blocks: int, hidden: int) -> None:
    """llama.cpp's legacy converter wrote fc1 as ffn_down and fc2 as ffn_up: when ffn_down reads the
    tower's width (torch [ffn, hidden]), it is fc1 (as llama.cpp's loader decides)."""
    for i in range(blocks):
        down = tensors.get(f"v.blk.{i}.ffn_down.weight")
        if down is None or len(down.shape) != 2 or down.shape[1] != hidden or down.shape[0] == hidden:
            continue
        for suffix in ("weight", "bias"):
            fc1, fc2 = (f"vision_tower.encoder.layers.{i}.mlp.{x}.{suffix}" for x in ("fc1", "fc2"))
            a, b = rules[fc1], rules[fc2]
            rules[fc1] = TensorRule(b.sources, b.combine, a.shape)
            rules[fc2] = TensorRule(a.sources, a.combine, b.shape)


_FAMILIES: dict[str, Callable[[str, dict, dict, str], Mmproj]] = {
    "gemma3": _gemma3,
    "qwen2.5vl_merger": _qwen_vl,
    "qwen2vl_merger": _qwen_vl,
    "mlp": _llava,
}
SUPPORTED_PROJECTORS = tuple(_FAMILIES)


# ---- checking and reading -----------------------------------------------------------------------
def _check_tensors(mm: Mmproj) -> None:
    """Every rule's tensors exist and have the shape the parameter needs (split parts: their sum)."""
    for name, rule in mm.rules.items():
        missing = [s for s in rule.sources if s not in mm.tensors]
        if missing:
            raise _fail(mm.path, f"tensor {missing[0]!r} is missing (needed for {name})")
        if rule.shape is None:
            continue
        shapes = [tuple(mm.tensors[s].shape) for s in rule.sources]
        got = _combined_shape(rule, shapes)
        if got != rule.shape:
            which = rule.sources[0] if len(rule.sources) == 1 else " + ".join(rule.sources)
            raise _fail(mm.path, f"tensor {which!r} has shape {list(shapes[0]) if len(shapes) == 1 else shapes}, "
                                 f"expected {list(rule.shape)} (for {name})")


def _combined_shape(rule: TensorRule, shapes: list[tuple[int, ...]]) -> tuple[int, ...]:
    if rule.combine is _cat:
        return (sum(s[0] for s in shapes), *shapes[0][1:]) if len(set(s[1:] for s in shapes)) == 1 else shapes[0]
    if rule.combine is _temporal_stack:
        first = shapes[0]
        return (*first[:2], len(shapes), *first[2:]) if len(set(shapes)) == 1 and len(first) == 4 else first
    return shapes[0]


def iter_mmproj_weights(mm: Mmproj, dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield `(our HF name, tensor)` for every vision parameter, dequantized, combined, in `dtype`."""
    from deepinfer.model_executor.loader.gguf import dequantize_tensor

    for name, rule in mm.rules.items():
        parts = [dequantize_tensor(mm.tensors[s], torch.float32) for s in rule.sources]
        yield name, rule.combine(parts).to(dtype)

