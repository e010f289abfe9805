"""Test-side helpers: tiny random HF checkpoints and a GGUF writer.

The writer follows llama.cpp's converter conventions independently of the loader under test:
llama.cpp tensor names, q/k rows permuted per head for the llama architecture, Gemma norms
stored as 1 + w, shapes written innermost-first by `gguf.GGUFWriter`; phi3's fused `attn_qkv` and
`ffn_up` (gate | up) as HF stores them, its LongRoPE factors as `rope_factors_short/long` tensors.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import gguf
import numpy as np
import torch

TINY_VOCAB = 64
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]
CHAT_TEMPLATE = "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}</s>{% endfor %}"

_TOP_LEVEL = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}
_IN_BLOCK = {
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "self_attn.qkv_proj": "attn_qkv",  # phi3's fused projections
    "mlp.gate_up_proj": "ffn_up",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_GEMMA3_IN_BLOCK = {
    **_IN_BLOCK,
    "post_attention_layernorm": "post_attention_norm",
    "pre_feedforward_layernorm": "ffn_norm",
    "post_feedforward_layernorm": "post_ffw_norm",
}


def tiny_hf_config(arch: str, **overrides):
    """A tiny transformers config for `arch` (llama, qwen2, qwen3, gemma3)."""
    from transformers import Gemma3TextConfig, LlamaConfig, Qwen2Config, Qwen3Config

    common = dict(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=96,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        bos_token_id=1,
        eos_token_id=2,
        pad_token_id=2,
    )
    if arch == "llama":
        config = LlamaConfig(**common, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})
    elif arch == "qwen2":
        config = Qwen2Config(**common, rope_parameters={"rope_type": "default", "rope_theta": 1e6})
    elif arch == "qwen3":
        config = Qwen3Config(
            **common, head_dim=32, rope_parameters={"rope_type": "default", "rope_theta": 1e6}
        )
    elif arch == "gemma3":
        common.update(num_hidden_layers=7, num_key_value_heads=1, pad_token_id=0, rms_norm_eps=1e-6)
        config = Gemma3TextConfig(**common, head_dim=32, sliding_window=16, query_pre_attn_scalar=32)
    else:
        raise ValueError(arch)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def random_hf_model(config, seed: int = 0):
    """A *ForCausalLM with every parameter drawn at random (norms included, so +1/-1 slips show)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0.0, 0.5)
    return model.eval()


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's converter permutation of q/k rows for interleaved RoPE (HF -> GGUF)."""
    rest = weight.shape[1:]
    head_dim = weight.shape[0] // num_heads
    return weight.reshape(num_heads, 2, head_dim // 2, *rest).swapaxes(1, 2).reshape(weight.shape)


def llama3_rope_freqs(rope: dict, head_dim: int) -> np.ndarray:
    """llama.cpp's `rope_freqs` divisors for HF llama3 rope parameters."""
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    values = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * rope["rope_theta"] ** (i / head_dim)
        if wavelen < old / high:
            values.append(1.0)
        elif wavelen > old / low:
            values.append(factor)
        else:
            smooth = (old / wavelen - low) / (high - low)
            values.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(values, dtype=np.float32)


def gguf_tensor_name(arch: str, hf_name: str) -> str:
    stem, suffix = hf_name.rsplit(".", 1)
    if stem in _TOP_LEVEL:
        return f"{_TOP_LEVEL[stem]}.{suffix}"
    _, _, layer, part = stem.split(".", 3)
    table = _GEMMA3_IN_BLOCK if arch in ("gemma2", "gemma3") else _IN_BLOCK
    return f"blk.{layer}.{table[part]}.{suffix}"


def _write_metadata(writer: gguf.GGUFWriter, arch: str, config) -> None:
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    head_dim = _hd(config)
    if arch == "gemma3":
        writer.add_rope_freq_base(config.rope_parameters["full_attention"]["rope_theta"])
        writer.add_sliding_window(config.sliding_window)
    elif arch == "gemma2":  # as llama.cpp's converter: no rope base (10000), the caps and the window
        writer.add_attn_logit_softcapping(config.attn_logit_softcapping)
        writer.add_final_logit_softcapping(config.final_logit_softcapping)
        writer.add_sliding_window(config.sliding_window)
    else:
        writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    if arch == "phi3":
        _write_phi3_metadata(writer, config)
    if arch == "llama":
        writer.add_rope_dimension_count(head_dim)
    if arch in ("qwen3", "gemma3", "gemma2"):
        writer.add_key_length(head_dim)
        writer.add_value_length(head_dim)


def _write_phi3_metadata(writer: gguf.GGUFWriter, config) -> None:
    """llama.cpp's phi3 keys: rotating dims, original length, the window (0: none) and, with LongRoPE,
    the attention factor."""
    rope = config.rope_parameters
    original = rope.get("original_max_position_embeddings", config.original_max_position_embeddings)
    writer.add_rope_dimension_count(int(rope.get("partial_rotary_factor", 1.0) * config.hidden_size)
                                    // config.num_attention_heads)
    writer.add_rope_scaling_orig_ctx_len(original)
    writer.add_sliding_window(config.sliding_window or 0)
    scale = config.max_position_embeddings / original
    if rope.get("rope_type") == "longrope":
        writer.add_rope_scaling_attn_factors(math.sqrt(1 + math.log(scale) / math.log(original)) if scale > 1 else 1.0)


def _write_tokenizer(writer: gguf.GGUFWriter, vocab_size: int, control: dict[int, str] | None = None) -> None:
    """A tiny byte-level BPE vocabulary: specials, 'a', 'b', the merge 'ab', then fillers; `control`
    renames fillers (id -> text) into more control tokens."""
    tokens = SPECIAL_TOKENS + ["a", "b", "ab"] + [f"t{i}" for i in range(vocab_size - 6)]
    types = [3, 3, 3] + [1] * (vocab_size - 3)
    for token_id, text in (control or {}).items():
        tokens[token_id], types[token_id] = text, 3
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(["a b"])
    writer.add_bos_token_id(1)
    writer.add_eos_token_id(2)
    writer.add_pad_token_id(2)
    writer.add_chat_template(CHAT_TEMPLATE)


def _encode(array: np.ndarray, qtype) -> tuple[np.ndarray, object]:
    if qtype is None or array.ndim < 2:
        return array.astype(np.float32), None
    if qtype == gguf.GGMLQuantizationType.F16:
        return array.astype(np.float16), None
    return gguf.quants.quantize(array.astype(np.float32), qtype), qtype


def write_gguf(path, arch: str, config, state_dict: dict, qtype=None, extra=None, tokenizer=True,
               split_max_tensors: int = 0, control_tokens: dict[int, str] | None = None) -> str:
    """Write `state_dict` (HF names) as llama.cpp would; 2-D weights in `qtype` (None: F32). With
    `split_max_tensors`, a split set as gguf-split writes it (NAME-00001-of-0000N.gguf ...): the first
    part's path is returned. `control_tokens` (id -> text) names some fillers as control tokens."""
    writer = gguf.GGUFWriter(str(path), arch, split_max_tensors=split_max_tensors)
    _write_metadata(writer, arch, config)
    if tokenizer:
        _write_tokenizer(writer, config.vocab_size, control_tokens)
    for key, value in (extra or {}).items():
        writer.add_key_value(key, *value)
    for hf_name, tensor in state_dict.items():
        array = tensor.detach().float().numpy()
        if arch == "llama" and (".q_proj." in hf_name or ".k_proj." in hf_name):
            heads = config.num_attention_heads if ".q_proj." in hf_name else config.num_key_value_heads
            array = llama_cpp_permute(array, heads)
        if arch in ("gemma2", "gemma3") and hf_name.endswith("norm.weight"):
            array = array + 1.0
        data, raw_dtype = _encode(array, qtype)
        writer.add_tensor(gguf_tensor_name(arch, hf_name), data, raw_dtype=raw_dtype)
    if arch == "llama" and config.rope_parameters.get("rope_type") == "llama3":
        writer.add_tensor("rope_freqs.weight", llama3_rope_freqs(config.rope_parameters, _hd(config)))
    if arch == "phi3" and config.rope_parameters.get("rope_type") == "longrope":
        for kind in ("long", "short"):
            writer.add_tensor(f"rope_factors_{kind}.weight",
                              np.array(config.rope_parameters[f"{kind}_factor"], dtype=np.float32))
    names = writer.format_shard_names(Path(path))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return str(names[0])


def _hd(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def transformers_gguf_state_dict(path: str) -> dict[str, torch.Tensor]:
    """The reference: transformers' own GGUF loader on the same file."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(
        os.path.dirname(path), gguf_file=os.path.basename(path), dtype=torch.float32
    )
    return {name: tensor.detach() for name, tensor in model.state_dict().items()}
