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

Each comes as an `ExpertStack`, decoded when loading asks for it: whole (`read`), or a rank's
experts alone (`narrow` on dim 0, what a ShardSpec of an expert-parallel rank reads), from those
experts' bytes of the file's mapping.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterator

import numpy as np
import torch

from deepinfer.model_executor.layers.ops.mxfp4 import BLOCK, BLOCK_BYTES
from deepinfer.model_executor.loader.gguf_file import GGUFTensor, as_tensor

EXPERT_STACKS = ("ffn_gate_exps", "ffn_up_exps", "ffn_down_exps")
_GGML_BLOCK_BYTES = 1 + BLOCK_BYTES


def is_expert_stack(name: str) -> bool:
    """`blk.N.ffn_{gate,up,down}_exps.{weight,bias}`."""
    parts = name.split(".")
    return len(parts) == 4 and parts[0] == "blk" and parts[2] in EXPERT_STACKS


def ggml_mxfp4_to_hf(data: np.ndarray) -> tuple[torch.Tensor, torch.Tensor]:
    """ggml MXFP4 rows uint8 [..., nb * 17] -> (blocks [..., nb, 16], scales [..., nb]) in HF's order."""
    raw = as_tensor(data)  # [..., nb * 17]: a view of the file's mapping, or a copy
    raw = raw.view(*raw.shape[:-1], raw.shape[-1] // _GGML_BLOCK_BYTES, _GGML_BLOCK_BYTES)  # [..., nb, 17]
    qs = raw[..., 1:]  # [..., nb, 16]
    codes = torch.cat((qs & 0x0F, qs >> 4), dim=-1)  # [..., nb, 32]: the values in order
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # [..., nb, 16]
    return blocks.contiguous(), raw[..., 0].contiguous()


def ggml_mxfp4_scales(data: np.ndarray) -> torch.Tensor:
    """ggml MXFP4 rows uint8 [..., nb * 17] -> their scale bytes [..., nb] (HF's `*_scales`)."""
    raw = as_tensor(data)  # [..., nb * 17]: a view of the file's mapping, or a copy
    return raw.view(*raw.shape[:-1], raw.shape[-1] // _GGML_BLOCK_BYTES, _GGML_BLOCK_BYTES)[..., 0].contiguous()


def _interleave(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """gate, up [E, I, ...] -> [E, 2I, ...]: gate at rows 2c, up at 2c + 1."""
    return torch.stack((gate, up), dim=2).flatten(1, 2)


def _experts_of(tensor: GGUFTensor, start: int, length: int) -> GGUFTensor:
    """Experts [start, start + length) of an expert stack or bias [E, ...]: a view of their bytes."""
    return dataclasses.replace(tensor, shape=(length, *tensor.shape[1:]), data=tensor.data[start:start + length])


class ExpertStack:
    """One HF expert tensor [E, ...] built from GGUF stacks (`parts`, each [E, ...]) by `build`, not
    decoded yet. `shape`, `read()` (all experts) and `narrow(dim, start, length)`: on dim 0 only
    those experts' bytes are decoded (as loader/hf.py's SafetensorsSlice and gguf_slice.GGUFSlice)."""

    def __init__(self, shape: tuple[int, ...], build: Callable[..., torch.Tensor], *parts: GGUFTensor):
        self.shape = torch.Size(shape)
        self._build, self._parts = build, parts

    def read(self) -> torch.Tensor:
        return self._build(*self._parts)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        if dim != 0:
            return self.read().narrow(dim, start, length)
        if not 0 <= start <= start + length <= self.shape[0]:
            raise ValueError(f"experts [{start}, {start + length}) are outside the {self.shape[0]} of "
                             f"{self._parts[0].name!r}")
        return self._build(*(_experts_of(t, start, length) for t in self._parts))


def iter_gpt_oss_experts(tensors: list[GGUFTensor], dtype: torch.dtype,
                         dequantize: Callable[[GGUFTensor, torch.dtype], torch.Tensor]
                         ) -> Iterator[tuple[str, ExpertStack]]:
    """(HF name, ExpertStack) of every layer's experts from the file's expert stacks (`is_expert_stack`),
    decoded when read; `dequantize(tensor, dtype)` decodes a stack of another type than MXFP4 (in torch
    shape) and the biases."""
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
        if "ffn_gate_exps.bias" in parts and "ffn_up_exps.bias" in parts:
            gate, up = parts["ffn_gate_exps.bias"], parts["ffn_up_exps.bias"]  # [E, I] each
            yield f"{prefix}.gate_up_proj_bias", ExpertStack(
                (gate.shape[0], 2 * gate.shape[1]),
                lambda g, u: _interleave(dequantize(g, dtype), dequantize(u, dtype)), gate, up)  # [E, 2I]
        if "ffn_down_exps.bias" in parts:
            down = parts["ffn_down_exps.bias"]  # [E, H]
            yield f"{prefix}.down_proj_bias", ExpertStack(down.shape, lambda d: dequantize(d, dtype), down)


def _weights(prefix: str, parts: dict[str, GGUFTensor], dtype: torch.dtype,
             dequantize: Callable) -> Iterator[tuple[str, ExpertStack]]:
    """One layer's expert matrices: packed if every stack is MXFP4, dense if none is."""
    gate, up, down = (parts[f"{p}.weight"] for p in EXPERT_STACKS)
    kinds = {t.tensor_type.name for t in (gate, up, down)}
    e, inter, hidden = gate.shape  # torch order: [E, I, H] values
    if kinds == {"MXFP4"}:
        nb_h, nb_i = hidden // BLOCK, inter // BLOCK  # blocks per row
        yield f"{prefix}.gate_up_proj_blocks", ExpertStack(
            (e, 2 * inter, nb_h, BLOCK_BYTES),
            lambda g, u: _interleave(ggml_mxfp4_to_hf(g.data)[0], ggml_mxfp4_to_hf(u.data)[0]), gate, up)
        yield f"{prefix}.gate_up_proj_scales", ExpertStack(
            (e, 2 * inter, nb_h), lambda g, u: _interleave(ggml_mxfp4_scales(g.data), ggml_mxfp4_scales(u.data)),
            gate, up)
        yield f"{prefix}.down_proj_blocks", ExpertStack(
            (e, hidden, nb_i, BLOCK_BYTES), lambda d: ggml_mxfp4_to_hf(d.data)[0], down)
        yield f"{prefix}.down_proj_scales", ExpertStack((e, hidden, nb_i), lambda d: ggml_mxfp4_scales(d.data), down)
    elif "MXFP4" in kinds:
        raise ValueError(f"GGUF expert stacks of {gate.name.rsplit('.', 2)[0]} mix MXFP4 with "
                         f"{sorted(kinds - {'MXFP4'})}: all or none must be MXFP4")
    else:
        yield f"{prefix}.gate_up_proj", ExpertStack(
            (e, hidden, 2 * inter),
            lambda g, u: _interleave(dequantize(g, dtype), dequantize(u, dtype)).transpose(1, 2).contiguous(),
            gate, up)  # [E, H, 2I]
        yield f"{prefix}.down_proj", ExpertStack(
            (e, inter, hidden), lambda d: dequantize(d, dtype).transpose(1, 2).contiguous(), down)  # [E, I, H]


def experts_are_mxfp4(tensor_types: dict[str, str]) -> bool:
    """Whether the file's expert weight stacks are MXFP4 (ValueError when only some are)."""
    kinds = {kind for name, kind in tensor_types.items() if is_expert_stack(name) and name.endswith(".weight")}
    if "MXFP4" in kinds and len(kinds) > 1:
        raise ValueError(f"GGUF expert stacks mix MXFP4 with {sorted(kinds - {'MXFP4'})}: all or none must be MXFP4")
    return kinds == {"MXFP4"}

