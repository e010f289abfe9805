"""Dequantization of DeepSeek-V4 checkpoint tensors for the CPU path.

V4 checkpoints store most linear weights quantized, each with a sibling scale tensor:
- FP8: `weight` as float8_e4m3fn `[..., R, C]`, one scale per 128 x 128 block
  `[..., ceil(R/128), ceil(C/128)]` (edge blocks may be partial);
- FP4 (routed experts): `weight` as int8 / uint8 / float4_e2m1fn_x2 `[..., R, C/2]`, two e2m1
  values per byte, element 2j in the low nibble and 2j+1 in the high nibble; one scale per 32
  consecutive input values, `[..., R, C/32]`.
Scales are UE8M0 (float8_e8m0fnu, or raw uint8 bytes: 2 ** (byte - 127)) or plain floats
(V3-style fp32). Value = element * scale.

Scale names: DeepSeek's own `X.scale` beside `X.weight`; HF's `X.weight_scale_inv` beside
`X.weight`; HF stacked experts `P_scale_inv` beside `P`. A `.scale` tensor without a quantized
`.weight` sibling (e.g. an mHC `attn_hc.scale`) is an ordinary parameter and passes through.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

import torch
from torch import nn

from deepinfer.model_executor.layers.parallel_linear import shard_spec_of
from deepinfer.model_executor.models.deepseek_v4.names import expert_target, module_name

FP8_BLOCK = (128, 128)
FP4_GROUP = 32
# e2m1 code -> value; bit 3 is the sign, bits 2..1 the exponent, bit 0 the mantissa
FP4_E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
_FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    """Whether `tensor` is an FP8 e4m3 or packed-FP4 weight (and so needs a scale).

    int8 / uint8 count as packed FP4 only for weight names (`*.weight`, stacked `*_proj`), so that
    integer tables such as `tid2eid` pass through. A lazy slice answers by its stored dtype.
    """
    dtype = tensor.dtype if isinstance(tensor, torch.Tensor) else _stored(tensor).dtype
    if dtype in (torch.float8_e4m3fn, torch.float4_e2m1fn_x2):
        return True
    return dtype in (torch.int8, torch.uint8) and name.endswith((".weight", "_proj"))


def scale_to_float(scale: torch.Tensor) -> torch.Tensor:
    """UE8M0 (float8_e8m0fnu or raw uint8 exponent bytes) or float scales -> fp32."""
    if scale.dtype == torch.uint8:
        return torch.exp2(scale.float() - 127.0)
    return scale.float()


def unpack_fp4(packed: torch.Tensor) -> torch.Tensor:
    """Packed e2m1 bytes [..., C/2] -> fp32 values [..., C] (low nibble first)."""
    codes = packed.contiguous().view(torch.uint8)  # [..., C/2]
    lut = torch.tensor(FP4_E2M1_VALUES, dtype=torch.float32, device=packed.device)  # [16]
    pairs = torch.stack([lut[(codes & 0xF).long()], lut[(codes >> 4).long()]], dim=-1)  # [..., C/2, 2]
    return pairs.flatten(-2)  # [..., C]


def _apply_block_scale(values: torch.Tensor, scale: torch.Tensor, block: tuple[int, int],
                       name: str) -> torch.Tensor:
    rows, cols = values.shape[-2:]
    grid = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale.shape[-2:]) != grid or scale.shape[:-2] != values.shape[:-2]:
        raise ValueError(f"scale of {name!r} has shape {tuple(scale.shape)}, expected "
                         f"{tuple(values.shape[:-2]) + grid} for a weight of shape {tuple(values.shape)}")
    s = scale_to_float(scale)  # [..., gr, gc]
    s = s.repeat_interleave(block[0], dim=-2)[..., :rows, :]  # [..., R, gc]
    s = s.repeat_interleave(block[1], dim=-1)[..., :cols]  # [..., R, C]
    return values * s  # [..., R, C]


def dequantize_fp8(weight: torch.Tensor, scale: torch.Tensor, block: tuple[int, int] = FP8_BLOCK,
                   name: str = "weight") -> torch.Tensor:
    """e4m3 [..., R, C] with block scales [..., ceil(R/b0), ceil(C/b1)] -> fp32 [..., R, C]."""
    return _apply_block_scale(weight.float(), scale, block, name)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, group: int = FP4_GROUP,
                   name: str = "weight") -> torch.Tensor:
    """Packed e2m1 [..., R, C/2] with scales [..., R, C/group] -> fp32 [..., R, C]."""
    return _apply_block_scale(unpack_fp4(packed), scale, (1, group), name)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, name: str = "weight") -> torch.Tensor:
    """Dispatch on the weight's storage dtype: FP8 e4m3 or packed FP4 -> fp32."""
    if weight.dtype == torch.float8_e4m3fn:
        return dequantize_fp8(weight, scale, name=name)
    if weight.dtype in _FP4_DTYPES:
        return dequantize_fp4(weight, scale, name=name)
    raise ValueError(f"tensor {name!r} has dtype {weight.dtype}, expected float8_e4m3fn or packed FP4")


def weight_name_for_scale(name: str) -> str | None:
    """The weight a scale tensor belongs to, or None when `name` is not a scale name."""
    if name.endswith(".weight_scale_inv"):
        return name[: -len("_scale_inv")]
    if name.endswith("_scale_inv"):
        return name[: -len("_scale_inv")]
    if name.endswith(".scale"):
        return name[: -len("scale")] + "weight"
    return None


def dequantize_v4_weights(named_tensors: Iterable[tuple[str, torch.Tensor]],
                          dtype: torch.dtype = torch.bfloat16) -> Iterator[tuple[str, torch.Tensor]]:
    """Turn (quantized weight, scale) pairs into plain `dtype` tensors under the weight's name.

    Other tensors pass through unchanged. Each half of a pair waits (buffered) until the other
    half arrives, so any order works; safetensors' sorted order keeps the buffer to one pair.
    Raises ValueError for a quantized weight without a scale or a `*_scale_inv` without a weight.
    """
    weights: dict[str, torch.Tensor] = {}  # quantized weights waiting for a scale
    scales: dict[str, tuple[str, torch.Tensor]] = {}  # weight name -> (scale name, scale)
    for name, tensor in named_tensors:
        target = weight_name_for_scale(name)
        if target is not None:
            if target in weights:
                yield target, _dequantized(weights.pop(target), tensor, target, dtype)
            else:
                scales[target] = (name, tensor)
        elif is_quantized(name, tensor):
            if name in scales:
                yield name, _dequantized(tensor, scales.pop(name)[1], name, dtype)
            else:
                weights[name] = tensor
        else:
            yield name, tensor
    yield from _leftovers(weights, scales)


def _dequantized(weight, scale, name: str, dtype: torch.dtype):
    """The pair dequantized now, or (either half a lazy slice) a QuantizedSlice that reads what is asked."""
    if isinstance(weight, torch.Tensor) and isinstance(scale, torch.Tensor):
        return dequantize(weight, scale, name).to(dtype)
    return QuantizedSlice(weight, scale, name, dtype)


class QuantizedSlice:
    """A quantized weight and its scale not read yet: `.shape` of the values; `.read()` dequantizes
    all of it; `.narrow(dim, start, length)` reads only the scale blocks that hold the slice (FP8:
    128 rows or columns; FP4: one row, 32 columns) and their weight bytes, dequantizes them and cuts
    the slice out: a tensor-parallel rank never reads its partners' rows of a split weight."""

    def __init__(self, weight, scale, name: str, dtype: torch.dtype):
        self._weight, self._scale, self._name, self._dtype = weight, scale, name, dtype
        fp8 = _stored(weight).dtype == torch.float8_e4m3fn
        lead = (1,) * (len(weight.shape) - 2)  # stacked experts: one per index
        self._block = lead + (FP8_BLOCK if fp8 else (1, FP4_GROUP))
        self._packing = 1 if fp8 else 2  # values per stored byte along the last dim
        self.shape = torch.Size([*weight.shape[:-1], weight.shape[-1] * self._packing])

    def read(self) -> torch.Tensor:
        return dequantize(_whole(self._weight), _whole(self._scale), self._name).to(self._dtype)

    def narrow(self, dim: int, start: int, length: int) -> torch.Tensor:
        dim %= len(self.shape)
        block, per = self._block[dim], self._packing if dim == len(self.shape) - 1 else 1
        first, last = start // block, -(-(start + length) // block)  # the scale blocks that hold it
        lo, hi = first * block, min(last * block, self.shape[dim])
        weight = self._weight.narrow(dim, lo // per, (hi - lo) // per)
        values = dequantize(weight, self._scale.narrow(dim, first, last - first), self._name)
        return values.narrow(dim, start - lo, length).to(self._dtype)


def _whole(tensor) -> torch.Tensor:
    return tensor if isinstance(tensor, torch.Tensor) else tensor.read()


def _leftovers(weights: dict[str, torch.Tensor],
               scales: dict[str, tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    if weights:
        raise ValueError(f"quantized tensor {next(iter(weights))!r} has no scale tensor")
    for scale_name, scale in scales.values():
        if scale_name.endswith("_scale_inv"):
            raise ValueError(f"scale tensor {scale_name!r} has no quantized weight")
        yield scale_name, scale


def is_mtp_name(name: str) -> bool:
    return name.startswith(("mtp.", "model.mtp."))


def owned_tensors(named_tensors, owns) -> Iterator[tuple[str, object]]:
    """What a tensor-parallel rank reads: per-expert tensors (and their scales) of experts it does
    not hold (`owns(experts module name, expert)` false) are dropped unread; the rest pass through
    (lazy slices stay lazy: `QuantizedSlice` reads a split weight's blocks)."""
    for name, tensor in named_tensors:
        expert = expert_target(weight_name_for_scale(name) or name)
        if expert is None or owns(module_name(expert[0]), expert[1]):
            yield name, tensor


def _stored(lazy) -> torch.Tensor:
    """An empty tensor of a lazy slice's stored dtype (read whole when it has no dimension)."""
    return lazy.narrow(0, 0, 0) if len(lazy.shape) else lazy.read()


def load_v4_weights(module: nn.Module, weights, rename=module_name) -> set[str]:
    """Copy (name, tensor) pairs into `module`; returns the parameter names loaded.

    Per-expert matrices go into the stacked expert weights; a shared expert's gate / up go into
    its merged gate_up projection. A parameter split over tensor-parallel ranks (`shard_specs`)
    reads only the rank's slice of a lazy slice; others read it whole.
    """
    params = dict(module.named_parameters())
    loaded: set[str] = set()
    for name, tensor in weights:
        expert = expert_target(name)
        if expert is not None:
            owner = rename(expert[0])
            module.get_submodule(owner).load_expert_weight(expert[1], expert[2], tensor)
            loaded.add(f"{owner}.{'down_proj' if expert[2] in ('w2', 'down_proj') else 'gate_up_proj'}")
            continue
        target = rename(name)
        shared = _SHARED_GATE_UP.match(target)
        if shared:
            target = f"{shared.group(1)}.gate_up_proj.weight"
            half = params[target].shape[0] // 2
            dst = params[target].data[:half] if shared.group(2) == "gate" else params[target].data[half:]
        elif target in params:
            dst = params[target].data
        else:
            raise ValueError(f"checkpoint tensor {name!r} ({target!r}) has no matching parameter")
        owner, _, leaf = target.rpartition(".")
        spec = shard_spec_of(module.get_submodule(owner), leaf) if owner else None
        if spec is not None:
            spec.load(dst, 0, tensor, name)
            loaded.add(target)
            continue
        tensor = _whole(tensor)
        if dst.shape != tensor.shape:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(tensor.shape)}, expected {tuple(dst.shape)}")
        dst.copy_(tensor)
        loaded.add(target)
    return loaded


_SHARED_GATE_UP = re.compile(r"^(.*\.shared_experts)\.(gate|up)_proj\.weight$")
