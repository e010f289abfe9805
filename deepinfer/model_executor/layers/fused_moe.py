"""Routed experts and the shared expert as modules, for every MoE family.

`FusedExperts` holds E SwiGLU experts as stacks and runs them through the `grouped_moe` hook of
the kernel set bound with the caches (layers/moe.py's torch reference or ops/triton/moe.py), with
expert parallelism (a rank holds a contiguous slice of the experts) and a batch-invariant path.
`QuantFusedExperts` is its twin whose experts stay in ggml blocks (one `QuantWeight` per expert and
projection: a GGUF file's rows of that expert, or `--quantization int8|int4`), multiplied by
`quant_grouped_experts` with the integer CPU kernels. `SharedExpert` is the dense SwiGLU MLP some
families add to every token.

Loading: a checkpoint's experts come one matrix per expert (`load_expert_weight`: published files,
what `save_pretrained` writes, a GGUF file's 3-D tensors cut per expert by the loader) or stacked
over the experts (`load_stacked`: transformers' fused `gate_up_proj [E, 2I, H]` / `down_proj
[E, H, I]`); `finish_loading` checks that every held expert arrived and returns the module to keep:
the stacks, or the quantized twin when every matrix arrived as a `QuantWeight`.
"""

from __future__ import annotations

import logging
from functools import partial

import torch
from torch import nn

from deepinfer.contracts.weight_storage import EXPERTS
from deepinfer.model_executor.layers.activation import GatedMLP
from deepinfer.model_executor.layers.batch_invariant import linear as invariant_linear
from deepinfer.model_executor.layers.kernel_set import CPU_KERNELS, KernelSet
from deepinfer.model_executor.layers.moe import clamped_swiglu
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref, qmatmul, quantize_weight
from deepinfer.model_executor.layers.parallel_linear import ShardSpec, expert_piece
from deepinfer.model_executor.layers.quant_linear import QUANTIZATION_SCHEMES, PackedModule, kind_runs

logger = logging.getLogger("deepinfer.quantization")

# checkpoint projection name -> its role in an expert (HF names, DeepSeek / Mixtral w1 w3 w2)
EXPERT_PROJECTIONS = {"gate_proj": "gate", "w1": "gate", "up_proj": "up", "w3": "up", "down_proj": "down",
                      "w2": "down"}
_ROLES = ("gate", "up", "down")
_QUANT_BLOCK = 32  # values per Q8_0 / Q4_1 block: quantizing at load needs K a multiple of it


class _RoutedExperts(nn.Module):
    """What both expert modules share: the rank's slice of the E experts (`expert_piece`), the range
    check of the ids, and the partial output of the held experts under expert parallelism.

    `forward(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]`; subclasses give
    `_all_pairs` (ids are local, every pair held) and `_per_token` (batch-invariant mode)."""

    batch_invariant = False

    def __init__(self, num_experts: int, swiglu_limit: float | None, expert_parallel_size: int):
        super().__init__()
        self.num_experts, self.swiglu_limit = num_experts, swiglu_limit
        self.expert_parallel_size = expert_parallel_size
        piece = expert_piece(num_experts, expert_parallel_size)
        self.expert_start, self.num_local = piece.start, piece.length

    def owns(self, expert: int) -> bool:
        """Whether this rank holds expert `expert` (a global id)."""
        return self.expert_start <= expert < self.expert_start + self.num_local

    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        flat_ids = topk_ids.reshape(-1)  # [T*k]
        # a host sync, so checked on the CPU only (the routers' top-k yields ids in range by construction)
        checked = not x.is_cuda and flat_ids.numel()
        if checked and not 0 <= int(flat_ids.min()) <= int(flat_ids.max()) < self.num_experts:
            raise ValueError(f"topk_ids must lie in [0, {self.num_experts}), got {flat_ids.min()}..{flat_ids.max()}")
        if self.batch_invariant:
            return self._per_token(x, topk_ids, topk_weights)  # [T, H]
        if self.num_local < self.num_experts:
            return self._local_pairs(x, topk_ids, topk_weights)  # [T, H]
        return self._all_pairs(x, topk_ids, topk_weights)  # [T, H]

    def _local_pairs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The partial output [T, H] of the pairs whose expert this rank holds, run as one pair per row."""
        k = topk_ids.shape[1]
        local = topk_ids.reshape(-1) - self.expert_start  # [T*k]
        pairs = torch.nonzero((local >= 0) & (local < self.num_local)).squeeze(-1)  # [P]
        tokens = pairs // k  # [P]
        y = self._all_pairs(x[tokens], local[pairs, None], topk_weights.reshape(-1)[pairs, None])  # [P, H]
        out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)  # [T, H]
        out.index_add_(0, tokens, y.float())
        return out.to(x.dtype)  # [T, H]

    def _all_pairs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _per_token(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class FusedExperts(_RoutedExperts):
    """E routed SwiGLU experts with stacked weights, called like a grouped GEMM.

    Parameters: `gate_up_proj [E, 2I, H]` (gate rows, then up rows), `down_proj [E, H, I]`.
    `forward(x [T, H], topk_ids [T, k], topk_weights [T, k]) -> [T, H]`. The grouped GEMM is the
    `grouped_moe` hook of the kernel set bound with the caches (layers/kernel_set.py): the torch
    reference (layers/moe.py: pairs sorted by expert, each active expert once over its contiguous
    rows, an fp32 scatter-add) or two Triton grouped-GEMM launches (ops/triton/moe.py).

    With `expert_parallel_size` ep > 1 the module holds experts [start, start + E/ep) of the
    E (`expert_piece`), ids stay global, and only the pairs of held experts are computed (their
    ids shifted to local ones); the others add nothing to the [T, H] partial output.

    `batch_invariant` (DEEPINFER_BATCH_INVARIANT): `_per_token` instead of the hook, so a token's
    output does not depend on which other tokens share its experts.
    """

    param_storage = {"gate_up_proj": EXPERTS, "down_proj": EXPERTS}  # stored as the checkpoint's experts

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int, swiglu_limit: float | None,
                 expert_parallel_size: int = 1):
        super().__init__(num_experts, swiglu_limit, expert_parallel_size)
        self.kernels: KernelSet = CPU_KERNELS  # the grouped_moe hook: set when the model binds its caches
        self.gate_up_proj = nn.Parameter(torch.zeros(self.num_local, 2 * intermediate_size, hidden_size))
        self.down_proj = nn.Parameter(torch.zeros(self.num_local, hidden_size, intermediate_size))
        if self.num_local < num_experts:
            spec = ShardSpec(0, (expert_piece(num_experts, expert_parallel_size),))
            self.shard_specs = {"gate_up_proj": spec, "down_proj": spec}
        self._loaded: set[tuple[int, str]] = set()  # (local expert, role) copied or kept packed
        self._packed: dict[tuple[int, str], QuantWeight] = {}  # matrices that arrived quantized

    # ---- loading -------------------------------------------------------------------------------
    def load_expert_weight(self, expert: int, proj: str, tensor) -> None:
        """Copy one expert's [out, in] matrix into the stacks (a `QuantWeight` is kept for the
        quantized twin instead; a lazy slice is read only for a held expert).

        `proj`: `gate_proj` / `w1`, `up_proj` / `w3`, `down_proj` / `w2` (HF / DeepSeek, Mixtral names).
        """
        if not 0 <= expert < self.num_experts:
            raise ValueError(f"expert must lie in [0, {self.num_experts}), got {expert}")
        if proj not in EXPERT_PROJECTIONS:
            raise ValueError(f"proj must be one of {sorted(EXPERT_PROJECTIONS)}, got {proj!r}")
        if not self.owns(expert):
            return  # another rank's expert: never read
        tensor = tensor if isinstance(tensor, torch.Tensor | QuantWeight) else tensor.read()  # a lazy slice, whole
        e, role = expert - self.expert_start, EXPERT_PROJECTIONS[proj]  # the local index
        target = self._target(e, role)
        if tuple(target.shape) != tuple(tensor.shape):
            raise ValueError(f"expert {expert} {proj} has shape {tuple(tensor.shape)}, expected {tuple(target.shape)}")
        if isinstance(tensor, QuantWeight):
            self._packed[(e, role)] = tensor
        else:
            target.copy_(tensor)
        self._loaded.add((e, role))

    def load_stacked(self, proj: str, tensor) -> None:
        """All E experts' matrices of one projection, stacked [E, out, in]: `gate_up_proj` (gate
        rows, then up rows), `gate_proj`, `up_proj` or `down_proj`. Only the held experts are read."""
        if proj not in ("gate_up_proj", *EXPERT_PROJECTIONS):
            raise ValueError(f"proj must be gate_up_proj or one of {sorted(EXPERT_PROJECTIONS)}, got {proj!r}")
        if len(tensor.shape) != 3 or tensor.shape[0] != self.num_experts:
            raise ValueError(f"stacked experts {proj} have shape {tuple(tensor.shape)}, expected "
                             f"[{self.num_experts}, out, in]")
        held = tensor.narrow(0, self.expert_start, self.num_local)  # [E_local, out, in]
        for i in range(self.num_local):
            expert = self.expert_start + i
            if proj == "gate_up_proj":
                gate, up = held[i].chunk(2, dim=0)  # [I, H] each
                self.load_expert_weight(expert, "gate_proj", gate)
                self.load_expert_weight(expert, "up_proj", up)
            else:
                self.load_expert_weight(expert, proj, held[i])

    def finish_loading(self) -> nn.Module:
        """The module to keep once the checkpoint is read: this one, or a `QuantFusedExperts` when
        every held matrix arrived quantized (some packed, some not: the packed ones are dequantized
        into the stacks). ValueError naming an expert matrix the checkpoint lacked."""
        expected = {(e, r) for e in range(self.num_local) for r in _ROLES}
        missing = sorted(expected - self._loaded)
        if missing:
            e, role = missing[0]
            raise ValueError(f"checkpoint lacks {len(missing)} of {len(expected)} expert matrices, e.g. expert "
                             f"{self.expert_start + e} {role}")
        packed, self._packed, self._loaded = self._packed, {}, set()
        if len(packed) == len(_ROLES) * self.num_local:
            return QuantFusedExperts.from_packed(self, packed)
        if packed:
            logger.warning("%d of %d expert matrices arrived quantized, the others dense: all are dequantized",
                           len(packed), len(_ROLES) * self.num_local)
        for (e, role), weight in packed.items():
            self._target(e, role).copy_(dequantize_ref(weight))
        return self

    def _target(self, e: int, role: str) -> torch.Tensor:
        """The rows of local expert `e`'s `role` matrix in the stacks: a view."""
        inter = self.down_proj.shape[-1]
        if role == "down":
            return self.down_proj.data[e]  # [H, I]
        return self.gate_up_proj.data[e, :inter] if role == "gate" else self.gate_up_proj.data[e, inter:]  # [I, H]

    # ---- forward -------------------------------------------------------------------------------
    def forward(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        if self._packed:  # quantized matrices wait for finish_loading: the stacks hold zeros there
            raise RuntimeError(f"{len(self._packed)} expert matrices arrived quantized and were not installed: "
                               "the model must call finish_loading() after loading")
        return super().forward(x, topk_ids, topk_weights)  # [T, H]

    def _per_token(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """Each held expert over its rows through `batch_invariant.linear` (a row's bits do not
        depend on the rows beside it); then per token its weighted expert outputs added in
        ascending expert id (a stable sort of its k ids), in fp32. Other ranks' experts add 0."""
        num_tokens, k = topk_ids.shape
        ids, order = topk_ids.sort(dim=1, stable=True)  # [T, k] each token's experts ascending
        weights = topk_weights.gather(1, order).float()  # [T, k]
        flat = ids.reshape(-1) - self.expert_start  # [T*k] local ids
        outs = torch.zeros(num_tokens * k, x.shape[-1], dtype=torch.float32, device=x.device)  # [T*k, H]
        for e in torch.unique(flat).tolist():
            if not 0 <= e < self.num_local:
                continue
            pairs = torch.nonzero(flat == e).squeeze(-1)  # [P]
            act = clamped_swiglu(invariant_linear(x[pairs // k], self.gate_up_proj[e]), self.swiglu_limit)  # [P, I]
            outs[pairs] = invariant_linear(act, self.down_proj[e]).float()  # [P, H]
        terms = outs.view(num_tokens, k, -1) * weights[..., None]  # [T, k, H]
        total = terms[:, 0]  # [T, H]
        for j in range(1, k):
            total = total + terms[:, j]
        return total.to(x.dtype)  # [T, H]

    def _all_pairs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """x [T, H], ids [T, k] of held experts (local ids), weights [T, k] -> [T, H]."""
        return self.kernels.grouped_moe(x, topk_ids, topk_weights, self.gate_up_proj, self.down_proj,
                                        self.swiglu_limit)  # [T, H]


class QuantFusedExperts(_RoutedExperts, PackedModule):
    """`FusedExperts`' twin with each held expert's matrices kept in ggml blocks.

    `gate_up[e]`: the parts of local expert e's gate|up rows (one part per run of a ggml type,
    `kind_runs`: gate and up of one type are one part, multiplied with one quantization of the
    activations); `down[e]`: its [H, I] matrix. `qweights` lists every part (byte counts, numerics).
    The forward is `quant_grouped_experts`; it is batch-invariant as it is (`_per_token`)."""

    def __init__(self, num_experts: int, swiglu_limit: float | None, expert_parallel_size: int,
                 gate_up: list[tuple[QuantWeight, ...]], down: list[QuantWeight]):
        super().__init__(num_experts, swiglu_limit, expert_parallel_size)
        if len(gate_up) != self.num_local or len(down) != self.num_local:
            raise ValueError(f"QuantFusedExperts holds {self.num_local} experts, got {len(gate_up)} gate|up "
                             f"and {len(down)} down matrices")
        self.gate_up, self.down = tuple(gate_up), tuple(down)

    @classmethod
    def from_packed(cls, experts: FusedExperts, packed: dict[tuple[int, str], QuantWeight]) -> QuantFusedExperts:
        """The twin of `experts` from its held matrices, `packed[(local expert, role)]`."""
        gate_up = [kind_runs([packed[(e, "gate")], packed[(e, "up")]]) for e in range(experts.num_local)]
        down = [packed[(e, "down")] for e in range(experts.num_local)]
        return cls(experts.num_experts, experts.swiglu_limit, experts.expert_parallel_size, gate_up, down)

    @property
    def qweights(self) -> tuple[QuantWeight, ...]:
        return tuple(w for parts in self.gate_up for w in parts) + self.down

    def _all_pairs(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        return quant_grouped_experts(x, topk_ids, topk_weights, self.gate_up, self.down, self.swiglu_limit)

    def _per_token(self, x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor) -> torch.Tensor:
        """The grouped path: a row's product does not depend on the rows beside it (`qmatmul`
        quantizes and multiplies row by row), and a token's k outputs are added in ascending
        expert id (the pairs' stable sort by expert), in fp32."""
        if self.num_local < self.num_experts:
            return self._local_pairs(x, topk_ids, topk_weights)  # [T, H]
        return self._all_pairs(x, topk_ids, topk_weights)  # [T, H]

    def extra_repr(self) -> str:
        kinds = sorted({w.kind for w in self.qweights})
        return f"experts={self.num_local}/{self.num_experts}, {'+'.join(kinds)}"


def quant_grouped_experts(x: torch.Tensor, topk_ids: torch.Tensor, topk_weights: torch.Tensor,
                          gate_up: tuple[tuple[QuantWeight, ...], ...], down: tuple[QuantWeight, ...],
                          swiglu_limit: float | None) -> torch.Tensor:
    """x [T, H], topk_ids [T, k] (experts 0 .. E-1 of these lists), topk_weights [T, k] -> [T, H].

    The (token, slot) pairs sorted by expert (stable); each active expert once over its contiguous
    rows: `qmatmul` of the rows with its gate|up parts (one activation quantization for all parts),
    the SwiGLU, `qmatmul` with its down matrix; the weighted outputs scatter-added in fp32.
    """
    num_tokens, k = topk_ids.shape
    flat_ids = topk_ids.reshape(-1)  # [T*k]
    order = flat_ids.argsort(stable=True)  # [T*k] pairs grouped by expert
    token_idx = order // k  # [T*k]
    counts = torch.bincount(flat_ids, minlength=len(down)).tolist()  # E
    rows = x[token_idx]  # [T*k, H]
    hidden = torch.empty(rows.shape, dtype=torch.float32, device=x.device)  # [T*k, H]
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        part = rows[start:start + count].float()  # [n, H]
        act = clamped_swiglu(qmatmul(part, gate_up[expert]), swiglu_limit)  # [n, I]
        hidden[start:start + count] = qmatmul(act, down[expert])  # [n, H]
        start += count
    weights = topk_weights.reshape(-1)[order].float().unsqueeze(-1)  # [T*k, 1]
    out = torch.zeros(num_tokens, x.shape[-1], dtype=torch.float32, device=x.device)  # [T, H]
    out.index_add_(0, token_idx, hidden * weights)
    return out.to(x.dtype)  # [T, H]


def quantize_experts(model: nn.Module, scheme: str) -> int:
    """`--quantization int8|int4`: swap every `FusedExperts` whose H and I are multiples of 32 for a
    `QuantFusedExperts` of its experts in Q8_0 (int8) or Q4_1 (int4) blocks; returns how many."""
    if scheme not in QUANTIZATION_SCHEMES:
        raise ValueError(f"quantization scheme must be one of {QUANTIZATION_SCHEMES}, got {scheme!r}")
    swapped = 0
    for name, module in list(model.named_modules()):
        if not isinstance(module, FusedExperts):
            continue
        hidden, inter = module.down_proj.shape[1:]
        if hidden % _QUANT_BLOCK or inter % _QUANT_BLOCK:
            logger.info("experts %s stay unquantized (H=%d, I=%d not multiples of %d)", name, hidden, inter,
                        _QUANT_BLOCK)
            continue
        gate_up = [(quantize_weight(module.gate_up_proj[e], scheme),) for e in range(module.num_local)]
        down = [quantize_weight(module.down_proj[e], scheme) for e in range(module.num_local)]
        model.set_submodule(name, QuantFusedExperts(module.num_experts, module.swiglu_limit,
                                                    module.expert_parallel_size, gate_up, down))
        swapped += 1
    return swapped


class SharedExpert(GatedMLP):
    """Dense clamped-SwiGLU MLP held whole on every rank (the gated MLP, layers/activation.py);
    HF `gate_proj`/`up_proj` load into the merged `gate_up_proj`."""

    def __init__(self, hidden_size: int, intermediate_size: int, swiglu_limit: float | None):
        super().__init__(hidden_size, intermediate_size, partial(clamped_swiglu, limit=swiglu_limit), split=False)
        self.swiglu_limit = swiglu_limit
