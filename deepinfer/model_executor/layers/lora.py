"""LoRA on a model's linear layers: adapter slots beside each target module, added by a forward hook.

Each target module (a q|k|v, o, gate|up or down projection; float, quantized, split or whole) gets a
`LoRALayer`: per merged piece (q, k, v; gate, up) A [S, r_max, in], B [S, out_piece, r_max] and
scale [S] for the S = max_loras slots, zero where a slot's adapter does not target the piece or
has a smaller rank. A forward hook adds the delta to the module's output, never touching its
weight (a quantized base stays packed: y = qmatmul(x) + delta):

    y = module(x)                                    [T, out]    q | k | v
    y[:, piece] += lora_delta(x, slots, A, B, scale) [T, size]   each piece its own columns

`lora_delta` is the engine's kernel set's hook (`KernelSet.lora_delta`, layers/kernel_set.py), given at
install: the set, not the layer, picks the C++, Triton or torch implementation.

Tensor parallelism splits A and B like the base: a column-parallel module (q|k|v, gate|up) holds
the rank's rows of each piece's B and all of A; a row-parallel one (o, down) the rank's input
columns of A and all of B, so its delta is a partial sum, all-reduced like the base's.

The step's per-row slots (-1: no adapter) are set around the forward (`LoRAModel.active`); outside
it (CUDA graph capture, the start-up canary, a step without adapters) the hooks do nothing, so a
row without an adapter has the bits it has without LoRA. The slot tensors live outside the module
tree: they change neither parameter names nor the model's numerics record.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import all_reduce
from deepinfer.model_executor.layers.batch_invariant import BatchInvariantMode
from deepinfer.model_executor.layers.kernel_set import KernelSet
from deepinfer.model_executor.layers.parallel_linear import Piece, shard_spec_of
from deepinfer.model_executor.layers.quant_linear import QuantLinear, merged_sizes

TARGET_NAMES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass
class LoRAStep:
    """The step's adapter rows, read by every hook: `slots` [T] (None: no adapter this step), the
    slot ids used, the kernel set whose LoRA hooks compute the delta, and whether to compute it in
    batch-invariant mode."""

    kernels: KernelSet
    slots: torch.Tensor | None = None
    used: frozenset[int] = frozenset()
    batch_invariant: bool = False


@dataclass
class _Piece:
    """One HF projection inside a module's output: its local columns and its slot tensors."""

    hf_name: str
    offset: int
    size: int  # local output columns
    out_full: int  # the piece's output features on one rank
    rows: Piece | None  # column split: the B rows this rank holds
    A: torch.Tensor  # [S, r_max, in_local]
    B: torch.Tensor  # [S, size, r_max]
    scale: torch.Tensor  # [S] float32
    loaded: set[int] = field(default_factory=set)  # slots with an adapter on this piece


class LoRALayer:
    """The adapter slots of one linear module and the forward hook that adds their delta."""

    def __init__(self, step: LoRAStep, module: nn.Module, names: list[str], sizes: list[int],
                 num_slots: int, max_rank: int, dtype: torch.dtype, device: torch.device):
        self.step = step
        spec = shard_spec_of(module, "weight")
        self.row_split = spec is not None and spec.dim == 1  # a row-parallel module: its output is all-reduced
        self.in_piece = spec.pieces[0] if self.row_split else None
        in_local = module.in_features
        self.in_full = self.in_piece.full if self.row_split else in_local
        column = spec.pieces if spec is not None and spec.dim == 0 else [None] * len(sizes)
        zeros = dict(dtype=dtype, device=device)
        self.pieces, offset = [], 0
        for name, size, rows in zip(names, sizes, column, strict=True):
            self.pieces.append(_Piece(name, offset, size, rows.full if rows is not None else size, rows,
                                      torch.zeros(num_slots, max_rank, in_local, **zeros),
                                      torch.zeros(num_slots, size, max_rank, **zeros),
                                      torch.zeros(num_slots, dtype=torch.float32, device=device)))
            offset += size
        self.out_local = offset
        self.loaded: set[int] = set()  # slots with an adapter on some piece of this module
        self.handle = module.register_forward_hook(self)

    def shapes(self) -> dict[str, tuple[int, int]]:
        """HF name -> (in, out) features of each piece as one rank sees the checkpoint."""
        return {p.hf_name: (self.in_full, p.out_full) for p in self.pieces}

    # -- slots ---------------------------------------------------------------------------------------
    def write(self, slot: int, modules: dict) -> None:
        """Slot `slot` holds `modules` (HF name -> ModuleLoRA) from now on; pieces it does not target are zero."""
        for p in self.pieces:
            p.A[slot].zero_()
            p.B[slot].zero_()
            p.scale[slot] = 0.0
            p.loaded.discard(slot)
            lora = modules.get(p.hf_name)
            if lora is None:
                continue
            A, B, rank = lora.A, lora.B, lora.rank  # [r, in], [out, r]
            if self.row_split:
                A = A.narrow(1, self.in_piece.start, self.in_piece.length)  # [r, in_r]
                A = F.pad(A, (0, self.in_piece.local - self.in_piece.length))
            if p.rows is not None:
                B = F.pad(B.narrow(0, p.rows.start, p.rows.length), (0, 0, 0, p.rows.local - p.rows.length))
            p.A[slot, :rank].copy_(A)  # rows past the rank stay zero
            p.B[slot, :, :rank].copy_(B)
            p.scale[slot] = lora.scale
            p.loaded.add(slot)
        self.loaded = set().union(*(p.loaded for p in self.pieces))

    # -- the hook ------------------------------------------------------------------------------------
    def __call__(self, module: nn.Module, args: tuple, output: torch.Tensor) -> torch.Tensor | None:
        step = self.step
        if step.slots is None or not self.loaded & step.used:
            return None  # the module's output as it is
        x = args[0].reshape(-1, args[0].shape[-1])  # [T, in]
        if x.shape[0] != step.slots.shape[0]:
            raise RuntimeError(f"LoRA: a target module ran on {x.shape[0]} rows, the step has "
                               f"{step.slots.shape[0]}; adapters apply only to modules that see every row")
        # the C++ kernel's rows are independent as it is; the torch reference needs the mode for that
        invariant = step.batch_invariant and step.kernels.lora_op(x.device, x.dtype) != "cpu_kernel"
        with BatchInvariantMode() if invariant else contextlib.nullcontext():
            delta = torch.cat([self._piece_delta(p, x, step) for p in self.pieces], dim=-1)  # [T, out]
        if self.row_split:
            delta = all_reduce(delta)  # the ranks' partial sums over their input columns
        return output + delta.view(output.shape).to(output.dtype)

    @staticmethod
    def _piece_delta(p: _Piece, x: torch.Tensor, step: LoRAStep) -> torch.Tensor:
        if not p.loaded & step.used:
            return x.new_zeros(x.shape[0], p.size)  # [T, size]
        return step.kernels.lora_delta(x, step.slots, p.A, p.B, p.scale)  # [T, size]


class LoRAModel:
    """Every LoRA layer of one model, the step state their hooks read, and slot writes."""

    def __init__(self, layers: dict[str, LoRALayer], step: LoRAStep):
        self.layers, self.step = layers, step

    def targets(self) -> dict[str, tuple[int, int]]:
        """HF module name -> (in, out) features, for every piece of every layer."""
        return {name: shape for layer in self.layers.values() for name, shape in layer.shapes().items()}

    def write(self, slot: int, modules: dict) -> None:
        for layer in self.layers.values():
            layer.write(slot, modules)

    @contextlib.contextmanager
    def active(self, slots: torch.Tensor | None, used: frozenset[int]):
        """The hooks see `slots` [T] (the step's rows) inside; nothing outside, even after a fault."""
        self.step.slots, self.step.used = slots, used
        try:
            yield
        finally:
            self.step.slots, self.step.used = None, frozenset()


def install_lora(model: nn.Module, stacked: tuple, num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: torch.device, kernels: KernelSet, batch_invariant: bool = False) -> LoRAModel:
    """Attach a LoRALayer to each target module of `model`: linear modules (float or quantized) named
    like an HF projection in TARGET_NAMES, or merged ones (`stacked`: the loader's (HF fragment, our
    fragment, piece) table, e.g. (".q_proj.", ".qkv_proj.", 0)). ValueError when there is none. The
    deltas run through `kernels`' LoRA hooks."""
    merged: dict[str, list[str]] = {}
    for hf, ours, _ in sorted(stacked, key=lambda entry: entry[2]):
        merged.setdefault(ours.strip("."), []).append(hf.strip("."))
    step = LoRAStep(kernels, batch_invariant=batch_invariant)
    layers = {}
    for name, module in model.named_modules():
        prefix, _, leaf = name.rpartition(".")
        names = merged.get(leaf, [leaf] if leaf in TARGET_NAMES else [])
        sizes = _piece_sizes(module, len(names))
        if names and sizes is not None:
            hf_names = [f"{prefix}.{n}" if prefix else n for n in names]
            layers[name] = LoRALayer(step, module, hf_names, sizes, num_slots, max_rank, dtype, device)
    if not layers:
        raise ValueError(f"enable_lora: {type(model).__name__} has no linear layer LoRA can target "
                         f"({', '.join(TARGET_NAMES)})")
    return LoRAModel(layers, step)


def _piece_sizes(module: nn.Module, num_names: int) -> list[int] | None:
    """The local output sizes of a linear module's merged pieces; None when it is no linear layer
    or its pieces do not match the names."""
    if not num_names or not isinstance(module, nn.Linear | QuantLinear):
        return None
    spec = shard_spec_of(module, "weight")
    if spec is not None and spec.dim == 0:
        sizes = [p.local for p in spec.pieces]
    else:
        sizes = list(merged_sizes(module) or [module.out_features])
    return sizes if len(sizes) == num_names and sum(sizes) == module.out_features else None
