"""Linear and embedding layers whose weight stays quantized (`QuantWeight`, layers/ops/qmatmul.py).

A model is built with plain `nn.Linear` / `MergedLinear` / `nn.Embedding` modules; loading swaps a
module for its quantized twin when the checkpoint hands it a `QuantWeight` (a GGUF tensor kept in
its own quantization) or when `quantize_linears` quantizes it at load (`--quantization int8|int4`).
The twins keep the module's name and shard sizes, so the model code does not change:

    nn.Linear / MergedLinear  ->  QuantLinear      forward: qmatmul(x, W) (+ bias)
    nn.Embedding              ->  QuantEmbedding   forward: dequantize the looked-up rows only;
                                                   as a tied LM head: qmatmul(hidden, W)
    RowParallelLinear         ->  QuantRowParallelLinear     all_reduce(qmatmul(x_r, W_r)) (+ bias)
    VocabParallelEmbedding    ->  QuantVocabParallelEmbedding  the rank's rows; others zero, all_reduce
(a ColumnParallelLinear needs no collective: a QuantLinear of the rank's rows is its twin)

The shards of a merged projection (q|k|v, gate|up) may come in different formats (Gemma 3's v is
Q8_0 in some layers, its q and k Q5_0): they are brought to one layout first (`widen`), exactly.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import all_reduce
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref, qmatmul, quantize_weight
from deepinfer.model_executor.layers.parallel_linear import RowParallelLinear, VocabParallelEmbedding

logger = logging.getLogger("deepinfer.quantization")

QUANTIZATION_SCHEMES = ("int8", "int4")


class QuantLinear(nn.Module):
    """y = x W^T + b with W packed; `shard_sizes` kept for a merged projection."""

    def __init__(self, qweight: QuantWeight, bias: torch.Tensor | None, shard_sizes: list[int] | None = None):
        super().__init__()
        self.qweight = qweight
        self.out_features, self.in_features = qweight.shape
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        if shard_sizes is not None:
            self.shard_sizes = list(shard_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = qmatmul(x, self.qweight)  # [..., out]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        w = self.qweight
        return f"in={self.in_features}, out={self.out_features}, {w.kind} as {w.bits}-bit/{w.group}"


class QuantEmbedding(nn.Module):
    """An embedding table kept packed; rows are dequantized when looked up."""

    def __init__(self, qweight: QuantWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        rows = dequantize_ref(self.qweight.rows(ids.reshape(-1)))  # [T, hidden] fp32
        return rows.to(self.dtype).reshape(*ids.shape, self.embedding_dim)

    def _apply(self, fn, recurse=True):
        """Follow the model's dtype for looked-up rows; the packed table itself never changes."""
        probe = fn(torch.zeros((), dtype=self.dtype))
        if probe.is_floating_point():
            self.dtype = probe.dtype
        return super()._apply(fn, recurse)


class QuantRowParallelLinear(QuantLinear):
    """The rank's input columns of W packed: one all_reduce sums the ranks' products, the bias after."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(qmatmul(x, self.qweight))  # [..., out], summed over ranks
        return y if self.bias is None else y + self.bias.to(y.dtype)


class QuantVocabParallelEmbedding(QuantEmbedding):
    """The rank's vocabulary rows packed; ids outside them give zero rows before the all_reduce."""

    def __init__(self, qweight: QuantWeight, dtype: torch.dtype, vocab_start: int, vocab_rows: int):
        super().__init__(qweight, dtype)
        self.vocab_start, self.vocab_rows = vocab_start, vocab_rows

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start  # [T]
        inside = (local >= 0) & (local < self.vocab_rows)  # [T]
        rows = super().forward(torch.where(inside, local, 0))  # [T, E]
        return all_reduce(rows.masked_fill(~inside.unsqueeze(-1), 0.0))  # [T, E]


def head_logits(head: nn.Module, hidden: torch.Tensor) -> torch.Tensor:
    """hidden [N, H] @ head^T for an LM head given as a Linear or a (tied) Embedding, either form."""
    if isinstance(head, QuantLinear | QuantEmbedding):
        return qmatmul(hidden, head.qweight)  # [N, V]
    return F.linear(hidden, head.weight)  # [N, V]


# ---- swapping modules ---------------------------------------------------------------------------

def install_quantized(model: nn.Module, pending: dict[str, list[tuple[int | None, QuantWeight]]]) -> None:
    """Swap each module whose `weight` arrived quantized: `pending[param_name]` lists the
    (shard index or None, QuantWeight) pieces, all shards of a merged projection included."""
    for param_name, pieces in pending.items():
        module_name = param_name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        weight = _joined(param_name, module, pieces)
        _set_submodule(model, module_name, _twin(module, weight))


def _joined(name: str, module: nn.Module, pieces: list[tuple[int | None, QuantWeight]]) -> QuantWeight:
    sizes = getattr(module, "shard_sizes", None)
    if pieces[0][0] is None:
        return _checked(name, module, pieces[0][1])
    got = sorted(shard for shard, _ in pieces)
    if sizes is None or got != list(range(len(sizes))):
        raise ValueError(f"quantized weight {name!r} got shards {got}, expected {len(sizes or [])} of them")
    ordered = [w for _, w in sorted(pieces, key=lambda p: p[0])]
    for w, rows in zip(ordered, sizes, strict=True):
        if w.shape[0] != rows:
            raise ValueError(f"quantized shard of {name!r} has {w.shape[0]} rows, expected {rows}")
    return _checked(name, module, concat_rows(ordered))


def _checked(name: str, module: nn.Module, w: QuantWeight) -> QuantWeight:
    expected = tuple(module.weight.shape)
    if w.shape != expected:
        raise ValueError(f"checkpoint tensor {name!r} has shape {w.shape}, expected {expected}")
    return w


def _twin(module: nn.Module, weight: QuantWeight) -> nn.Module:
    if isinstance(module, VocabParallelEmbedding):
        return QuantVocabParallelEmbedding(weight, module.weight.dtype, module.vocab_start, module.vocab_rows)
    if isinstance(module, nn.Embedding):
        return QuantEmbedding(weight, module.weight.dtype)
    if isinstance(module, nn.Linear):
        cls = QuantRowParallelLinear if isinstance(module, RowParallelLinear) else QuantLinear
        return cls(weight, module.bias, getattr(module, "shard_sizes", None))
    raise ValueError(f"a quantized weight arrived for a {type(module).__name__}, which has no quantized twin")


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def concat_rows(weights: list[QuantWeight]) -> QuantWeight:
    """Stack weights on the output axis, widened to one layout (4 bits -> 8 bits, 32 -> 16 per group)."""
    bits, group = max(w.bits for w in weights), min(w.group for w in weights)
    same = [widen(w, bits, group) for w in weights]
    kinds = "+".join(dict.fromkeys(w.kind for w in weights))
    return QuantWeight(torch.cat([w.q for w in same]), torch.cat([w.scale for w in same]),
                       torch.cat([w.minv for w in same]), bits, group, kinds)


def widen(w: QuantWeight, bits: int, group: int) -> QuantWeight:
    """The same values in a wider layout: every value and scale is kept exactly."""
    if (w.bits, w.group) == (bits, group):
        return w
    n, k = w.shape
    q = w.q
    if w.bits == 4:  # 0..15 into int8, natural order
        packed = q.view(n, k // 32, 16)  # [N, groups, 16]
        q = torch.cat([packed & 0xF, packed >> 4], dim=-1).to(torch.int8).reshape(n, k)  # [N, K]
    repeat = w.group // group
    return QuantWeight(q.contiguous(), w.scale.repeat_interleave(repeat, dim=1),
                       w.minv.repeat_interleave(repeat, dim=1), bits, group, w.kind)


def quantize_linears(model: nn.Module, scheme: str, group: int = 32) -> int:
    """`--quantization int8|int4`: swap every plain Linear whose K is a multiple of `group` for a
    QuantLinear of its weight (and a tied or untied head alike); returns how many were swapped."""
    if scheme not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization scheme must be one of {QUANTIZATION_SCHEMES}, got {scheme!r}")
    swapped, kept = 0, []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Embedding or not isinstance(module, nn.Linear) or isinstance(module, QuantLinear):
            continue
        if module.in_features % group:
            kept.append(name)
            continue
        _set_submodule(model, name, _twin(module, quantize_weight(module.weight, scheme, group)))
        swapped += 1
    if kept:
        logger.info("%d linear layers stay unquantized (K not a multiple of %d), e.g. %s", len(kept), group, kept[0])
    return swapped
