"""GPT-OSS in GGUF (llama.cpp's `gpt-oss` architecture): the routed experts back in the HF checkpoint's layout.

llama.cpp's converter writes each layer's experts as three stacks `blk.N.ffn_{gate,up,down}_exps.weight`
[E, rows, cols] (gate and up split out of HF's interleaved gate|up rows: gate = rows 0::2, up = 1::2)
and their biases `blk.N.ffn_{gate,up,down}_exps.bias` [E, rows]. An MXFP4 stack holds ggml blocks:

    ggml   17 bytes per 32 values: [ e8m0 scale | 16 bytes: value j low nibble, value j + 16 high nibble ]
    HF     `*_blocks` 16 bytes: value 2j low nibble, value 2j + 1 high nibble;  `*_scales` apart

The same E2M1 codes and scale bytes, reordered. `iter_gpt_oss_experts` yields, per layer, the
`mlp.experts.gate_up_proj_{blocks,scales}` / `down_proj_{blocks,scales}` of the checkpoint the file was
converted from (rows interleaved again), or for stacks of another type HF's dense experts
`gate_up_proj` [E, H, 2I] and `down_proj` [E, I, H]; and the biases `gate_up_proj_bias` [E, 2I],
`down_proj_bias` [E, H].
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import numpy as np
import torch

from deepinfer.model_executor.layers.ops.mxfp4 import BLOCK_BYTES
from deepinfer.model_executor.loader.gguf_file import GGUFTensor

EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_GGML_BLOCK_BYTES = 1 + BLOCK_BYTES


def is_expert_stack(name: str) -> bool:
    """`blk.N.ffn_{gate,up,down}_exps.{weight,bias}`."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_STACKS


def ggml_mxfp4_to_hf(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows uint8 [..., nb * 17] -> (blocks [..., nb, 16], scales [..., nb]) in HF's order."""
    raw = torch.from_numpy(np.ascontiguousarray(data))
    raw = raw.view(*raw.shape[:-1], raw.shape[-1] // _GGML_BLOCK_BYTES, _GGML_BLOCK_BYTES)  # [..., nb, 17]
    qs = raw[..., 1:]  # [..., nb, 16]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., nb, 32]: the values in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., nb, 16]
    return blocks.contiguous(), raw[..., 0].contiguous()


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [E, I, ...] -> [E, 2I, ...]: gate at rows 2c, up at 2c + 1."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def iter_gpt_oss_experts(tensors: list[GGUFTensor], dtype: torch.dtype,
                         dequantize: Callable[[GGUFTensor, torch.dtype], torch.Tensor]
                         ) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every layer's experts from the file's expert stacks (`is_expert_stack`);
    `dequantize(tensor, dtype)` decodes a stack of another type than MXFP4 (in torch shape)."""
    layers: dict[int, dict[str, GGUFTensor]] = {}
    for tensor in tensors:
        _, layer, part, suffix = tensor.name.split(".")
        layers.setdefault(int(layer), {})[f"{part}.{suffix}"] = tensor
    for layer, parts in sorted(layers.items()):
        prefix = f"model.layers.{layer}.mlp.experts"
        missing = [f"{p}.weight" for p in EXPERT_STACKS if f"{p}.weight" not in parts]
        if missing:
            raise ValueError(f"GGUF layer {layer} lacks expert tensors {missing}")
        yield from _weights(prefix, parts, dtype, dequantize)
        for name, ours in (("gate_up_proj_bias", ("ffn_gate_exps.bias", "ffn_up_exps.bias")),
                           ("down_proj_bias", ("ffn_down_exps.bias",))):
            if all(p in parts for p in ours):
                biases = [dequantize(parts[p], dtype) for p in ours]  # [E, rows] each
                yield f"{prefix}.{name}", _interleave(*biases) if len(biases) == 2 else biases[0]


def _weights(prefix: str, parts: dict[str, GGUFTensor], dtype: torch.dtype,
             dequantize: Callable) -> Iterator[tuple[str, torch.Tensor]]:
    """One layer's expert matrices: packed if every stack is MXFP4, dense if none is."""
    gate, up, down = (parts[f"{p}.weight"] for p in EXPERT_STACKS)
    kinds = {t.tensor_type.name for t in (gate, up, down)}
    if kinds == {"MXFP4"}:
        (gb, gs), (ub, us), (db, ds) = (ggml_mxfp4_to_hf(t.data) for t in (gate, up, down))
        yield f"{prefix}.gate_up_proj_blocks", _interleave(gb, ub)  # [E, 2I, H/32, 16]
        yield f"{prefix}.gate_up_proj_scales", _interleave(gs, us)  # [E, 2I, H/32]
        yield f"{prefix}.down_proj_blocks", db  # [E, H, I/32, 16]
        yield f"{prefix}.down_proj_scales", ds  # [E, H, I/32]
    elif "MXFP4" in kinds:
        raise ValueError(f"GGUF expert stacks of {gate.name.rsplit('.', 2)[0]} mix MXFP4 with "
                         f"{sorted(kinds - {'MXFP4'})}: all or none must be MXFP4")
    else:
        gate_up = _interleave(dequantize(gate, dtype), dequantize(up, dtype))  # [E, 2I, H]
        yield f"{prefix}.gate_up_proj", gate_up.transpose(1, 2).contiguous()  # [E, H, 2I]
        yield f"{prefix}.down_proj", dequantize(down, dtype).transpose(1, 2).contiguous()  # [E, I, H]


def experts_are_mxfp4(tensor_types: dict[str, str]) -> bool:
    """Whether the file's expert weight stacks are MXFP4 (ValueError when only some are)."""
    kinds = {kind for name, kind in tensor_types.items() if is_expert_stack(name) and name.endswith(".weight")}
    if "MXFP4" in kinds and len(kinds) > 1:
        raise ValueError(f"GGUF expert stacks mix MXFP4 with {sorted(kinds - {'MXFP4'})}: all or none must be MXFP4")
    return kinds == {"MXFP4"}

