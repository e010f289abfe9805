"""Linear and embedding layers whose weight stays quantized (`QuantWeight`, layers/ops/qmatmul.py).

A model is built with plain `nn.Linear` / `MergedLinear` / `nn.Embedding` modules; loading swaps a
module for its quantized twin when the checkpoint hands it a `QuantWeight` (a GGUF tensor kept in
its own blocks) or when `quantize_linears` quantizes it at load (`--quantization int8|int4`).
The twins keep the module's name and shard sizes, so the model code does not change:

    nn.Linear / MergedLinear  ->  QuantLinear      forward: qmatmul(x, parts) (+ bias)
    nn.Embedding              ->  QuantEmbedding   forward: dequantize the looked-up rows only;
                                                   as a tied LM head: qmatmul(hidden, W)
    RowParallelLinear         ->  QuantRowParallelLinear     all_reduce(qmatmul(x_r, W_r)) (+ bias)
    VocabParallelEmbedding    ->  QuantVocabParallelEmbedding  the rank's rows; others zero, all_reduce
(a ColumnParallelLinear needs no collective: a QuantLinear of the rank's rows is its twin)

Every quantized module lists its weights in `qweights`. The shards of a merged projection (q|k|v,
gate|up) may come in different types (Gemma 3's v is Q8_0 in some layers, its q and k Q5_0): a run
of shards of one type is one part, and the parts are multiplied with one quantization of the
activations and their outputs concatenated; nothing is converted.

On the CPU the activations are quantized to int8 in one or two levels (ops/qdot.py): about 8 or
15 bits of each value, at twice the integer work for two. `activation_levels` chooses per module,
by what its rounding does to the tokens (measured on SmolLM2-135M and Gemma 3 270M):

    q/k/v, any 8-bit weight                 2   q and k feed softmax(q k^T), whose exponent turns a
                                                 small error into another attention pattern
    o, gate/up, down, the LM head           1   llama.cpp's Q8 activations, well below the
      with <= 6-bit weights                      weight's own rounding

Teacher-forced agreement with the fp32 forward of the same GGUF: 98.1% (SmolLM2) and 98.8%
(Gemma 3) this way, 100% with two levels everywhere, 95.6-96.9% (SmolLM2) with one everywhere
(docs/quantization.md). Both models' heads are Q8_0 (two levels); forced to one they agree on 97.8%
/ 98.4% (8 x 40 tokens) and 98.0% / 99.4% (8 x 120), so a head of at most 6 bits (Q6_K in Q4_K_M
files) takes one: it is up to a fifth of a decode step's bytes (Qwen2.5's 151,936 rows at 1.5B),
and a second level a sixth of its time.

The choice is a property of the module, never of the batch, so a row's bits still do not depend
on how many rows run with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import all_reduce
from deepinfer.model_executor.layers.ops.kernel_weights import KernelWeight, kernel_weight, qlinear_checked
from deepinfer.model_executor.layers.ops.qdot import ACT_LEVELS
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref, qmatmul, quantize_weight
from deepinfer.model_executor.layers.parallel_linear import (
    ColumnParallelLinear,
    MergedLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    shard_spec_of,
)

logger = logging.getLogger("deepinfer.quantization")

# Modules (by the last part of their name) whose activations take one level when their weights have
# at most 6 bits: the attention output, the MLP (dense or shared-expert) and the LM head (see the docstring).
ONE_LEVEL_PROJECTIONS = ("o_proj", "gate_up_proj", "gate_proj", "up_proj", "down_proj", "lm_head")
_EIGHT_BIT = ("Q8_0",)

QUANTIZATION_SCHEMES = ("int8", "int4")
_BLOCK = 32  # values per Q8_0 / Q4_1 block: a quantized layer's K is a multiple of it


class PackedModule:
    """What a module that keeps weights packed declares: every part in `qweights` (byte counts,
    numerics). QuantLinear, QuantEmbedding and fused_moe.QuantFusedExperts are such modules."""

    qweights: tuple[QuantWeight, ...]
    _checked: tuple[tuple[torch.Tensor, ...], tuple[KernelWeight, ...] | None] | None = None  # (bytes, checked)
    reads_own_bytes = False  # whether the module reads its parts' file-layout bytes beside the kernels

    def checked_weights(self, x: torch.Tensor) -> tuple[KernelWeight, ...] | None:
        """The parts checked for the CPU kernels (in their tile layout where they have one) when x is
        fp32 [M, K] on the CPU, kept until a part's bytes are replaced (e.g. moved to another
        device); else None (qmatmul's general path)."""
        if x.dim() != 2 or x.dtype is not torch.float32 or not x.is_cpu:
            return None
        data = tuple(w.data for w in self.qweights)
        cached = self._checked
        if cached is None or len(cached[0]) != len(data) or any(a is not b
                                                               for a, b in zip(cached[0], data, strict=True)):
            parts = tuple(kernel_weight(w, release=not self.reads_own_bytes) for w in self.qweights)
            cached = self._checked = (data, None if any(p is None for p in parts) else parts)
        return cached[1]


class QuantLinear(nn.Module, PackedModule):
    """y = x W^T + b with W packed, as parts stacked on the output axis (one per run of a type);
    `shard_sizes`: the rows of each projection of a merged one (q|k|v, gate|up), else None."""

    def __init__(self, qweights: QuantWeight | Sequence[QuantWeight], bias: torch.Tensor | None,
                 shard_sizes: list[int] | None = None, act_levels: int = ACT_LEVELS):
        super().__init__()
        self.qweights = (qweights,) if isinstance(qweights, QuantWeight) else tuple(qweights)
        self.act_levels = act_levels  # the activations' int8 levels on the CPU (activation_levels)
        self.out_features = sum(w.shape[0] for w in self.qweights)
        self.in_features = self.qweights[0].shape[1]
        if any(w.shape[1] != self.in_features for w in self.qweights):
            raise ValueError(f"QuantLinear parts have different input sizes: {[w.shape for w in self.qweights]}")
        self.bias = None if bias is None else nn.Parameter(bias.detach(), requires_grad=False)
        self.shard_sizes = None if shard_sizes is None else list(shard_sizes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        checked = self.checked_weights(x)
        if checked is not None:  # a step's usual call: the kernel calls alone, checked once per load
            y = qlinear_checked(x, checked, self.act_levels)  # [M, out]
        else:
            y = qmatmul(x, self.qweights, self.act_levels)  # [..., out]
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        kinds = "+".join(f"{w.kind}[{w.shape[0]}]" for w in self.qweights)
        return f"in={self.in_features}, out={self.out_features}, {kinds}, act_levels={self.act_levels}"


class QuantEmbedding(nn.Module, PackedModule):
    """An embedding table kept packed; rows are dequantized when looked up."""

    reads_own_bytes = True  # the looked-up rows (a tied head's tile layout is a second copy)

    def __init__(self, qweight: QuantWeight, dtype: torch.dtype = torch.float32):
        super().__init__()
        self.qweight = qweight
        self.num_embeddings, self.embedding_dim = qweight.shape
        self.dtype = dtype
        self.act_levels = activation_levels("lm_head", (qweight,))  # as a tied LM head

    @property
    def qweights(self) -> tuple[QuantWeight, ...]:
        return (self.qweight,)

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
        y = all_reduce(qmatmul(x, self.qweights, self.act_levels))  # [..., out], summed over ranks
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
    if isinstance(head, QuantLinear | QuantEmbedding):  # the integer kernels (two levels: activation_levels)
        checked = head.checked_weights(hidden)
        if checked is not None:  # a step's usual call, as QuantLinear.forward's
            return qlinear_checked(hidden, checked, head.act_levels)  # [N, V]
        return qmatmul(hidden, head.qweights, head.act_levels)  # [N, V]
    return F.linear(hidden, head.weight)  # [N, V]


def packed_weights(model: nn.Module) -> list[QuantWeight]:
    """Every packed weight (part) the model's quantized modules hold."""
    return [w for m in model.modules() if isinstance(m, PackedModule) for w in m.qweights]


def merged_sizes(module: nn.Module) -> list[int] | None:
    """The rows of each projection a merged linear module stacks on its output axis (q|k|v, gate|up:
    MergedLinear, ColumnParallelLinear, the QuantLinear of one); None for any other module."""
    if isinstance(module, MergedLinear | ColumnParallelLinear | QuantLinear):
        return module.shard_sizes
    return None


# ---- swapping modules ---------------------------------------------------------------------------

def install_quantized(model: nn.Module, pending: dict[str, list[tuple[int | None, QuantWeight]]]) -> None:
    """Swap each module whose `weight` arrived quantized: `pending[param_name]` lists the
    (shard index or None, QuantWeight) pieces, all shards of a merged projection included."""
    for param_name, pieces in pending.items():
        module_name = param_name.rsplit(".", 1)[0]
        module = model.get_submodule(module_name)
        weight = _joined(param_name, module, pieces)
        _set_submodule(model, module_name, _twin(module, weight, module_name))


def activation_levels(name: str, parts: Sequence[QuantWeight]) -> int:
    """The int8 levels of a quantized linear module's activations (module docstring): one for the
    attention output and the MLP with weights of at most 6 bits, two for everything else."""
    role = name.rsplit(".", 1)[-1]
    if role in ONE_LEVEL_PROJECTIONS and not any(w.kind in _EIGHT_BIT for w in parts):
        return 1
    return 2


def _joined(name: str, module: nn.Module,
            pieces: list[tuple[int | None, QuantWeight]]) -> tuple[QuantWeight, ...]:
    sizes = merged_sizes(module)
    if pieces[0][0] is None:
        return _checked(name, module, (pieces[0][1],))
    got = sorted(shard for shard, _ in pieces)
    if sizes is None or got != list(range(len(sizes))):
        raise ValueError(f"quantized weight {name!r} got shards {got}, expected {len(sizes or [])} of them")
    ordered = [w for _, w in sorted(pieces, key=lambda p: p[0])]
    for w, rows in zip(ordered, sizes, strict=True):
        if w.shape[0] != rows:
            raise ValueError(f"quantized shard of {name!r} has {w.shape[0]} rows, expected {rows}")
    return _checked(name, module, kind_runs(ordered))


def _checked(name: str, module: nn.Module, parts: tuple[QuantWeight, ...]) -> tuple[QuantWeight, ...]:
    expected = tuple(module.weight.shape)
    got = (sum(w.shape[0] for w in parts), parts[0].shape[1])
    if got != expected or any(w.shape[1] != got[1] for w in parts):
        raise ValueError(f"checkpoint tensor {name!r} has shape {[w.shape for w in parts]}, expected {expected}")
    return parts


def set_activation_levels(model: nn.Module, choice: str) -> None:
    """`--activation-levels`: "auto" keeps each module's `activation_levels`; "1" or "2" sets every
    quantized linear module (the LM head included) to that many levels."""
    if choice == "auto":
        return
    for module in model.modules():
        if isinstance(module, QuantLinear | QuantEmbedding):  # an embedding as a tied LM head
            module.act_levels = int(choice)


def _twin(module: nn.Module, weight: QuantWeight | tuple[QuantWeight, ...], name: str) -> nn.Module:
    parts = (weight,) if isinstance(weight, QuantWeight) else weight
    if isinstance(module, nn.Embedding):
        if len(parts) != 1:
            raise ValueError(f"an embedding table arrived in {len(parts)} parts")
        if isinstance(module, VocabParallelEmbedding):
            return QuantVocabParallelEmbedding(parts[0], module.weight.dtype, module.vocab_start, module.vocab_rows)
        return QuantEmbedding(parts[0], module.weight.dtype)
    if isinstance(module, nn.Linear):
        cls = QuantRowParallelLinear if isinstance(module, RowParallelLinear) else QuantLinear
        twin = cls(parts, module.bias, merged_sizes(module), activation_levels(name, parts))
        spec = shard_spec_of(module, "weight")
        if spec is not None:  # which slice it holds (LoRA splits its A / B alike)
            twin.shard_specs = {"weight": spec}
        return twin
    raise ValueError(f"a quantized weight arrived for a {type(module).__name__}, which has no quantized twin")


def _set_submodule(model: nn.Module, name: str, module: nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def kind_runs(weights: list[QuantWeight]) -> tuple[QuantWeight, ...]:
    """Weights stacked on the output axis as parts: each run of consecutive weights of one type is
    joined into one (their rows concatenated, bytes unchanged: a view of the file's mapping when
    they are neighbours in it, QuantWeight.stacked)."""
    runs: list[list[QuantWeight]] = []
    for w in weights:
        if runs and runs[-1][0].kind == w.kind:
            runs[-1].append(w)
        else:
            runs.append([w])
    return tuple(run[0] if len(run) == 1 else QuantWeight.stacked(run) for run in runs)


def quantize_linears(model: nn.Module, scheme: str) -> int:
    """`--quantization int8|int4`: swap every plain Linear whose K is a multiple of 32 (the block of
    Q8_0 and Q4_1) for a QuantLinear of its weight in Q8_0 (int8) or Q4_1 (int4) blocks
    (and a tied or untied head alike); returns how many were swapped."""
    if scheme not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization scheme must be one of {QUANTIZATION_SCHEMES}, got {scheme!r}")
    swapped, kept = 0, []
    for name, module in list(model.named_modules()):
        if type(module) is nn.Embedding or not isinstance(module, nn.Linear) or isinstance(module, QuantLinear):
            continue
        if module.in_features % _BLOCK:
            kept.append(name)
            continue
        _set_submodule(model, name, _twin(module, quantize_weight(module.weight, scheme), name))
        swapped += 1
    if kept:
        logger.info("%d linear layers stay unquantized (K not a multiple of %d), e.g. %s", len(kept), _BLOCK, kept[0])
    return swapped
