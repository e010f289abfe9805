"""Test-side writer of llama.cpp "mmproj" vision files, from a tiny HF vision-language model.

Written the way llama.cpp's converters write them, independently of the loader under test (which
reads the names back through the same `gguf` tables, but undoes the converter's transforms itself):

    names        HF names as the converter sees them (`vision_tower.vision_model.*`,
                 `multi_modal_projector.*`, `visual.*`), mapped by the `gguf` package's
                 `get_tensor_name_map(MODEL_ARCH.MMPROJ, blocks)` (convert_hf_to_gguf.py's map_tensor_name)
    Gemma 3      (Gemma3VisionModel) `mm_input_projection_weight` renamed `mm_input_projection.weight`
                 before mapping; `mm_soft_emb_norm.weight` stored as 1 + w; SigLIP's pooling head
                 skipped; the input projection forced to F16 and the embeddings to F32 in a F16 file;
                 `clip.vision.projector.scale_factor` written only when it is not 4
    Qwen2(.5)-VL (Qwen2VLVisionModel) `attn.qkv` split into q, k, v; the Conv3d patch kernel
                 [E, C, 2, p, p] split into `v.patch_embd.weight` (t = 0) and `v.patch_embd.weight.1`
                 (t = 1); Qwen2.5-VL: use_silu and n_wa_pattern = fullatt_block_indexes[0] + 1;
                 Qwen2-VL: feed_forward_length = vision hidden_size, embedding_length = embed_dim
    LLaVA-1.5    (the legacy convert_image_encoder_to_gguf.py) projector "mlp" as `mm.0` / `mm.2`
                 (LLaVA's mm_projector Sequential indices), the tower's last layer and post-layernorm
                 left out (block_count = layers - 1), fc1 written as ffn_down and fc2 as ffn_up (the
                 legacy naming llama.cpp's loader detects by shape), `v.class_embd` without suffix,
                 `clip.vision.projection_dim` CLIP's own projection size (not the text width)
    types        F32 everywhere, or F16 for weights of 2+ dims (vectors stay F32), or Q8_0 for the
                 2-D matrices whose rows are a multiple of 32 (the rest as F16)
"""

from __future__ import annotations

import gguf
import numpy as np
import torch

MEAN = [0.5, 0.5, 0.5]
STD = [0.5, 0.5, 0.5]


def _converter_view(name: str) -> str:
    """transformers 5 names -> the names the converter maps (transformers 4 checkpoints')."""
    for new, old in (("model.vision_tower.vision_model.", "vision_tower.vision_model."),
                     ("model.vision_tower.", "vision_tower.vision_model."),
                     ("model.multi_modal_projector.", "multi_modal_projector."), ("model.visual.", "visual.")):
        if name.startswith(new):
            return old + name[len(new):]
    return name


def _encode(name: str, array: np.ndarray, qtype: str):
    """(data, raw_dtype) of one tensor in the file's type (module docstring)."""
    if qtype == "f32" or array.ndim < 2:
        return array.astype(np.float32), None
    if qtype == "f16" or ".embeddings." in name:
        forced = np.float32 if (".embeddings." in name and qtype == "f16") else np.float16
        return array.astype(forced), None
    if qtype == "q8_0" and array.ndim == 2 and array.shape[-1] % 32 == 0:
        return gguf.quants.quantize(array.astype(np.float32), gguf.GGMLQuantizationType.Q8_0), \
            gguf.GGMLQuantizationType.Q8_0
    return array.astype(np.float16), None


def _write(path, keys: dict, tensors: list[tuple[str, np.ndarray]], qtype: str, skip_tensors=(), skip_keys=(),
           overrides=None) -> str:
    writer = gguf.GGUFWriter(str(path), "clip")
    keys = {**keys, **(overrides or {})}
    for key, (value, vtype) in keys.items():
        if key in skip_keys:
            continue
        if vtype == gguf.GGUFValueType.ARRAY:
            writer.add_array(key, value)
        else:
            writer.add_key_value(key, value, vtype)
    for name, array in tensors:
        if name in skip_tensors:
            continue
        data, raw = _encode(name, array, qtype)
        writer.add_tensor(name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(path)


U32, F32, STR, BOOL, ARR = (gguf.GGUFValueType.UINT32, gguf.GGUFValueType.FLOAT32, gguf.GGUFValueType.STRING,
                            gguf.GGUFValueType.BOOL, gguf.GGUFValueType.ARRAY)


def _base_keys(projector: str, vcfg: dict, text_hidden: int, blocks: int) -> dict:
    K = gguf.Keys.ClipVision
    return {gguf.Keys.Clip.PROJECTOR_TYPE: (projector, STR), gguf.Keys.Clip.HAS_VISION_ENCODER: (True, BOOL),
            K.PROJECTION_DIM: (text_hidden, U32), K.IMAGE_SIZE: (vcfg.get("image_size", 560), U32),
            K.PATCH_SIZE: (vcfg["patch_size"], U32), K.EMBEDDING_LENGTH: (vcfg["hidden"], U32),
            K.FEED_FORWARD_LENGTH: (vcfg["ffn"], U32), K.BLOCK_COUNT: (blocks, U32),
            K.Attention.HEAD_COUNT: (vcfg["heads"], U32), K.IMAGE_MEAN: (MEAN, ARR), K.IMAGE_STD: (STD, ARR),
            K.Attention.LAYERNORM_EPS: (vcfg.get("eps", 1e-6), F32)}


def write_gemma3_mmproj(path, hf_model, qtype: str = "f32", **edits) -> str:
    """Gemma3ForConditionalGeneration's tower + projector as llama.cpp's Gemma3VisionModel writes them."""
    cfg = hf_model.config
    v = cfg.vision_config
    blocks = v.num_hidden_layers
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, blocks)
    tensors = []
    for hf_name, tensor in hf_model.state_dict().items():
        name = _converter_view(hf_name)
        if not name.startswith(("vision_tower.", "multi_modal_projector.")) or "vision_model.head." in name:
            continue
        name = name.replace("_weight", ".weight")
        array = tensor.detach().float().numpy()
        if "soft_emb_norm.weight" in name:
            array = array + 1.0
        tensors.append((table.get_name(name, try_suffixes=(".weight", ".bias")), array))
    keys = _base_keys("gemma3", dict(image_size=v.image_size, patch_size=v.patch_size, hidden=v.hidden_size,
                                     ffn=v.intermediate_size, heads=v.num_attention_heads, eps=v.layer_norm_eps),
                      cfg.text_config.hidden_size, blocks)
    keys[gguf.Keys.ClipVision.USE_GELU] = (True, BOOL)
    scale = (v.image_size // v.patch_size) // round(cfg.mm_tokens_per_image ** 0.5)
    if scale != 4:
        keys[gguf.Keys.ClipVision.Projector.SCALE_FACTOR] = (scale, U32)
    return _write(path, keys, tensors, qtype, **edits)


def write_qwen_vl_mmproj(path, hf_model, qtype: str = "f32", **edits) -> str:
    """Qwen2-VL / Qwen2.5-VL's tower as llama.cpp's Qwen2VLVisionModel writes it."""
    cfg = hf_model.config
    v = cfg.vision_config
    qwen25 = cfg.model_type == "qwen2_5_vl"
    blocks = v.depth
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, max(blocks, 3))  # `mm.2` needs a table of 3+
    tensors = []
    for hf_name, tensor in hf_model.state_dict().items():
        name = _converter_view(hf_name)
        if not name.startswith("visual."):
            continue
        array = tensor.detach().float().numpy()
        if ".qkv." in name:
            for part, rows in zip("qkv", np.split(array, 3, axis=0), strict=True):
                tensors.append((table.get_name(name.replace("qkv", part), try_suffixes=(".weight", ".bias")), rows))
        elif "patch_embed.proj.weight" in name:
            base = gguf.TENSOR_NAMES[gguf.MODEL_TENSOR.V_ENC_EMBD_PATCH] + ".weight"
            tensors += [(base, array[:, :, 0]), (base + ".1", array[:, :, 1])]
        else:
            tensors.append((table.get_name(name, try_suffixes=(".weight", ".bias")), array))
    if qwen25:
        dims = dict(hidden=v.hidden_size, ffn=v.intermediate_size)
    else:
        dims = dict(hidden=v.embed_dim, ffn=v.hidden_size)
    keys = _base_keys("qwen2.5vl_merger" if qwen25 else "qwen2vl_merger",
                      dict(patch_size=v.patch_size, heads=v.num_heads, **dims), cfg.text_config.hidden_size, blocks)
    keys[gguf.Keys.ClipVision.SPATIAL_MERGE_SIZE] = (v.spatial_merge_size, U32)
    if qwen25:
        keys[gguf.Keys.ClipVision.USE_SILU] = (True, BOOL)
        keys[gguf.Keys.ClipVision.N_WA_PATTERN] = (v.fullatt_block_indexes[0] + 1, U32)
        keys[gguf.Keys.ClipVision.WINDOW_SIZE] = (v.window_size, U32)
    else:
        keys[gguf.Keys.ClipVision.USE_GELU] = (True, BOOL)
    return _write(path, keys, tensors, qtype, **edits)


def write_llava_mmproj(path, hf_model, qtype: str = "f32", **edits) -> str:
    """LlavaForConditionalGeneration (LLaVA-1.5, feature layer -2) as the legacy converter writes it."""
    cfg = hf_model.config
    v = cfg.vision_config
    blocks = v.num_hidden_layers - 1  # the last layer is never read
    table = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, v.num_hidden_layers)
    tensors = []
    for hf_name, tensor in hf_model.state_dict().items():
        name = _converter_view(hf_name)
        array = tensor.detach().float().numpy()
        if name.startswith("multi_modal_projector.linear_"):
            bid = 0 if ".linear_1." in name else 2
            tensors.append((f"mm.{bid}.{name.rsplit('.', 1)[1]}", array))
            continue
        if not name.startswith("vision_tower.") or "post_layernorm" in name or \
                f".layers.{v.num_hidden_layers - 1}." in name:
            continue
        gname = table.get_name(name, try_suffixes=(".weight", ".bias"))
        gname = gname.replace("ffn_up", "FC1").replace("ffn_down", "ffn_up").replace("FC1", "ffn_down")  # legacy
        tensors.append((gname, array))
    keys = _base_keys("mlp", dict(image_size=v.image_size, patch_size=v.patch_size, hidden=v.hidden_size,
                                  ffn=v.intermediate_size, heads=v.num_attention_heads, eps=v.layer_norm_eps),
                      cfg.text_config.hidden_size, blocks)
    keys[gguf.Keys.ClipVision.USE_GELU] = (v.hidden_act == "gelu", BOOL)
    keys[gguf.Keys.Clip.HAS_LLAVA_PROJECTOR] = (True, BOOL)
    keys[gguf.Keys.ClipVision.PROJECTION_DIM] = (v.projection_dim, U32)  # legacy: CLIP's own projection size
    return _write(path, keys, tensors, qtype, **edits)


def text_state_dict(hf_model) -> dict[str, torch.Tensor]:
    """The language model's tensors under a *ForCausalLM's names (`model.*`, `lm_head.*`), as the
    text converter reads a VL checkpoint (vision tensors skipped)."""
    out = {}
    for name, tensor in hf_model.state_dict().items():
        for old, new in (("model.language_model.", "model."), ("language_model.model.", "model."),
                         ("language_model.lm_head.", "lm_head.")):
            if name.startswith(old):
                name = new + name[len(old):]
                break
        if name.startswith(("model.vision_tower.", "model.visual.", "model.multi_modal_projector.")):
            continue
        out[name] = tensor
    if getattr(hf_model.config, "tie_word_embeddings", False) or \
            getattr(hf_model.config.get_text_config(), "tie_word_embeddings", False):
        out.pop("lm_head.weight", None)
    return out
