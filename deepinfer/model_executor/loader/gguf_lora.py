"""LoRA adapters in GGUF files (llama.cpp's `convert_lora_to_gguf.py`), read back into PEFT's names,
layout and config.

    metadata   general.type = "adapter", adapter.type = "lora", adapter.lora.alpha (float32),
               general.architecture = the base model's architecture
    tensors    per adapted base matrix, under llama.cpp's name of that matrix (`blk.N.attn_q.weight`):
                 `<name>.lora_a`   GGUF [in, r]  = torch [r, in]    PEFT `...q_proj.lora_A.weight`
                 `<name>.lora_b`   GGUF [r, out] = torch [out, r]   PEFT `...q_proj.lora_B.weight`
               in F32, F16, BF16 or Q8_0 (the converter's --outtype; a tensor whose rows are not whole
               Q8_0 blocks, such as lora_b of rank 16, falls back to F16)
    llama q/k  the converter sends the pair through the base's own conversion: reshapes and permutes
               act on lora_b's rows (lora_a is left as it is), so lora_b of attn_q / attn_k carries the
               base's per-head row interleave (gguf.py's `unpermute_qk`) and B A is the permuted delta.
               Undoing it needs the base's head counts, which an adapter file does not hold: pass the
               base's config (`num_attention_heads`, `num_key_value_heads`).
    scale      llama.cpp applies alpha / r, or 1 when alpha is 0 or absent; PEFT applies lora_alpha / r.
               The config says lora_alpha = alpha (absent: the rank, per module through `alpha_pattern`
               where ranks differ) and use_rslora = False.

Tensors come back as float32, named `base_model.model.<HF module>.lora_{A,B}.weight` (gguf.py's HF
names). What the converter can also write and a linear layer's delta does not cover (embedding LoRA on
`token_embd`, norms added by mergekit, expert stacks, activated LoRA) is refused with a ValueError
naming the file and the tensor.
"""

from __future__ import annotations

from collections import Counter
from typing import Any

import torch

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.model_executor.loader.gguf import dequantize_tensor, gguf_to_hf_name, unpermute_qk
from deepinfer.model_executor.loader.gguf_config import SUPPORTED_GGUF_ARCHITECTURES
from deepinfer.model_executor.loader.gguf_file import GGUFTensor, read_gguf_file

PEFT_PREFIX = "base_model.model."
_SUFFIXES = {".lora_a": "lora_A", ".lora_b": "lora_B"}
_PERMUTED = {"attn_q": "num_attention_heads", "attn_k": "num_key_value_heads"}  # llama's q/k rows


def read_gguf_lora(path: str, base_config: Any = None) -> tuple[dict, dict[str, torch.Tensor]]:
    """(PEFT adapter config, {PEFT tensor name: float32 tensor}) of the GGUF LoRA file at `path`.

    `base_config`: the base model's HF config (or a dict), whose head counts undo the q/k row interleave
    of a llama-architecture adapter; ValueError when such an adapter comes without one, and for a file
    that is not a plain LoRA adapter."""
    file = read_gguf_file(path)
    _check_metadata(file.metadata, path)
    arch = file.metadata["general.architecture"]
    tensors: dict[str, torch.Tensor] = {}
    for tensor in file.tensors:
        module, part, base_part = _peft_module(tensor, arch, path)
        weight = dequantize_tensor(tensor, torch.float32)  # [r, in] or [out, r]
        if arch == "llama" and base_part in _PERMUTED and part == "lora_B":
            weight = unpermute_qk(weight, _num_heads(base_config, file.metadata, _PERMUTED[base_part], path))
        tensors[f"{PEFT_PREFIX}{module}.{part}.weight"] = weight
    ranks = _module_ranks(tensors, path)
    return _peft_config(file.metadata, ranks), tensors


def _check_metadata(metadata: dict, path: str) -> None:
    """A LoRA adapter of a supported base architecture, not an activated LoRA."""
    kinds = (metadata.get("general.type"), metadata.get("adapter.type"))
    if kinds != ("adapter", "lora"):
        raise ValueError(f"{path!r} is not a GGUF LoRA adapter: general.type={kinds[0]!r}, adapter.type={kinds[1]!r} "
                         f"(expected 'adapter' and 'lora')")
    arch = metadata.get("general.architecture")
    if arch not in SUPPORTED_GGUF_ARCHITECTURES:
        raise ValueError(f"{path!r}: LoRA adapter for architecture {arch!r}, which is not supported; "
                         f"supported: {', '.join(SUPPORTED_GGUF_ARCHITECTURES)}")
    if "adapter.alora.invocation_tokens" in metadata:
        raise ValueError(f"{path!r}: an activated LoRA (adapter.alora.invocation_tokens) is not supported")


def _peft_module(tensor: GGUFTensor, arch: str, path: str) -> tuple[str, str, str]:
    """(HF module name, "lora_A" | "lora_B", llama.cpp's part name such as attn_q) of an adapter tensor."""
    suffix = next((s for s in _SUFFIXES if tensor.name.endswith(s)), None)
    base_name = tensor.name.removesuffix(suffix) if suffix else tensor.name
    if suffix is None or base_name.startswith("token_embd.") or len(tensor.shape) != 2:
        raise ValueError(f"{path!r}: tensor {tensor.name!r} {list(tensor.shape)} is not the lora_a / lora_b matrix "
                         f"of a linear layer (embedding LoRA, norms and expert stacks are not supported)")
    try:
        hf_name = gguf_to_hf_name(arch, base_name)
    except ValueError:
        raise ValueError(f"{path!r}: tensor {tensor.name!r} adapts {base_name!r}, which has no HF module for "
                         f"architecture {arch!r}") from None
    return hf_name.removesuffix(".weight"), _SUFFIXES[suffix], base_name.split(".")[-2]


def _num_heads(base_config: Any, metadata: dict, field: str, path: str) -> int:
    """The base's `field` (num_attention_heads / num_key_value_heads) from its config, else from head
    counts the file may carry (`llama.attention.head_count[_kv]`)."""
    if base_config is None:
        heads = kv_heads = None
    elif isinstance(base_config, dict):
        heads, kv_heads = base_config.get("num_attention_heads"), base_config.get("num_key_value_heads")
    else:
        fields = HFConfigFields.of(base_config)
        heads, kv_heads = fields.num_attention_heads, fields.num_key_value_heads
    value = heads if field == "num_attention_heads" else kv_heads
    if value is None and field == "num_key_value_heads":
        value = heads  # no GQA field: as many KV heads as heads
    if value is None:
        key = "llama.attention.head_count" + ("_kv" if field == "num_key_value_heads" else "")
        value = metadata.get(key, metadata.get("llama.attention.head_count"))
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{path!r}: a llama LoRA adapter of q/k needs the base model's {field} to undo llama.cpp's "
                         f"row interleave; the file has none, pass the base config (got {value!r})")
    return value


def _module_ranks(tensors: dict[str, torch.Tensor], path: str) -> dict[str, int]:
    """{HF module: rank}, each module's lora_A [r, in] and lora_B [out, r] present and of one rank."""
    ranks: dict[str, int] = {}
    for name, weight in tensors.items():
        if not name.endswith(".lora_A.weight"):
            continue
        module = name.removeprefix(PEFT_PREFIX).removesuffix(".lora_A.weight")
        b = tensors.get(f"{PEFT_PREFIX}{module}.lora_B.weight")
        if b is None or b.shape[1] != weight.shape[0]:
            found = "no lora_b" if b is None else f"lora_b {list(b.shape)}"
            raise ValueError(f"{path!r}: module {module!r} has lora_a {list(weight.shape)} and {found}; expected "
                             f"torch shapes [r, in] and [out, r]")
        ranks[module] = weight.shape[0]
    if not ranks or len(ranks) * 2 != len(tensors):
        raise ValueError(f"{path!r}: holds no LoRA tensors, or a lora_b without its lora_a")
    return ranks


def _peft_config(metadata: dict, ranks: dict[str, int]) -> dict:
    """PEFT's adapter_config for these modules: the most common rank as r, the others in rank_pattern."""
    r = Counter(ranks.values()).most_common(1)[0][0]
    alpha = float(metadata.get("adapter.lora.alpha") or 0.0)
    config = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "r": r, "lora_alpha": alpha or float(r),
        "target_modules": sorted({module.rsplit(".", 1)[-1] for module in ranks}),
        "use_rslora": False, "use_dora": False, "bias": "none", "fan_in_fan_out": False,
        "rank_pattern": {module: rank for module, rank in ranks.items() if rank != r},
        "alpha_pattern": {} if alpha else {module: float(rank) for module, rank in ranks.items() if rank != r},
    }
    return config
