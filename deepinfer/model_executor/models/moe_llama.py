"""Mixture-of-experts members of the Llama family: Qwen3-MoE, Qwen2-MoE and Mixtral.

The decoder is models/decoder.py's with the Llama spec (llama.py): attention, norms, RoPE, the LM head,
the cache groups and the loading of all but the experts are the Llama family's. The MLP of a sparse
layer is a router (layers/router.py), routed SwiGLU experts (layers/fused_moe.py) and, for
Qwen2-MoE, a gated shared expert, in fp32 where it routes:

    probs    = softmax(x W_router^T)            [T, E] fp32, over all E experts
    w, ids   = top-k(probs)                     [T, k]
    w        = w / sum_j w_j                    Mixtral always; Qwen only with `norm_topk_prob`
    y        = sum_j w_j expert_{ids_j}(x)      expert(x) = down(silu(gate x) * up x)
    y       += sigmoid(x g^T) shared(x)         Qwen2-MoE, g [1, H]

(Mixtral's renormalised top-k of the softmax equals a softmax over its top-k logits.) A Qwen layer is
dense (Llama's MLP, `intermediate_size`) when listed in `mlp_only_layers` or when (i + 1) is not a
multiple of `decoder_sparse_step`.

    family      attention            experts' size field       shared expert   names also read
    qwen3_moe   q/k norm             moe_intermediate_size     -
    qwen2_moe   q/k/v bias           moe_intermediate_size     yes
    mixtral     as Llama             intermediate_size         -               block_sparse_moe., w1 w3 w2

Checkpoint experts: one matrix per expert (`mlp.experts.N.gate_proj.weight`, what `save_pretrained`
writes and published files hold; a GGUF file's `ffn_*_exps` cut per expert by the loader) or
stacked (`mlp.experts.gate_up_proj [E, 2I, H]`, `mlp.experts.down_proj [E, H, I]`). Matrices that
arrive quantized (GGUF) stay so: the block swaps in `QuantFusedExperts`.

Parallelism: attention as Llama's. With tensor_parallel_size n > 1 a sparse block sums partial
outputs with one all_reduce: the routed experts split over expert_parallel_size ep rank groups
(ep = 1: every rank holds all of them and rank 0 computes them), the shared expert held whole and
added on rank 0. A dense layer is Llama's split MLP.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from functools import partial

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.distributed.parallel_state import all_reduce, tp_rank, tp_size
from deepinfer.model_executor.layers.fused_moe import FusedExperts, SharedExpert
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, dequantize_ref
from deepinfer.model_executor.layers.parallel_linear import computes_expert_slice
from deepinfer.model_executor.layers.router import Router, RouterSpec
from deepinfer.model_executor.models.decoder import DecoderLM, DecoderSpec, dense_mlp
from deepinfer.model_executor.models.llama import LlamaConfigFields, llama_spec
from deepinfer.model_executor.models.utils import load_weights

_EXPERT = re.compile(r"^(?P<owner>.+\.experts)\.(?P<expert>\d+)\.(?P<proj>\w+)\.weight$")
_STACKED = re.compile(r"^(?P<owner>.+\.experts)\.(?P<proj>gate_up_proj|down_proj)$")
_GATES = (".mlp.gate.weight", ".mlp.shared_expert_gate.weight")  # fp32 gates: read whole, never packed


@dataclass(frozen=True)
class MoeFamily:
    """What one MoE model type changes in the shared body."""

    qk_norm: bool = False  # per-head RMSNorm of q and k before RoPE
    reads_qkv_bias: bool = False  # the config's `qkv_bias` puts a bias on q, k and v (not on o)
    always_renormalize: bool = False  # renormalise the top-k weights whatever `norm_topk_prob` says
    shared_expert: bool = False  # a sigmoid-gated dense expert beside the routed ones
    expert_size: Callable = lambda cfg: cfg.moe_intermediate_size  # an expert's intermediate size
    dense_layers: bool = True  # `mlp_only_layers` / `decoder_sparse_step` make some layers dense


QWEN3_MOE = MoeFamily(qk_norm=True)
QWEN2_MOE = MoeFamily(reads_qkv_bias=True, shared_expert=True)
MIXTRAL = MoeFamily(always_renormalize=True, expert_size=lambda cfg: cfg.intermediate_size, dense_layers=False)


@dataclass(frozen=True)
class MoeConfigFields(LlamaConfigFields):
    """The optional config fields the MoE members read beside the Llama family's."""

    hidden_act: str = "silu"
    decoder_sparse_step: int = 1  # Qwen: layer i is sparse when (i + 1) is a multiple of it
    mlp_only_layers: Sequence[int] | None = None  # Qwen: the layers that stay dense
    norm_topk_prob: bool = False  # Qwen: renormalise the top-k weights
    qkv_bias: bool = False  # Qwen2-MoE: a bias on q, k and v


def moe_spec(cfg, family: MoeFamily) -> DecoderSpec:
    """The Llama spec with the family's attention choices and, on its sparse layers, a
    `SparseMoeBlock`; every optional config field the family reads is read here."""
    fields = MoeConfigFields.of(cfg)
    if fields.hidden_act != "silu":
        raise ValueError(f"hidden_act={fields.hidden_act!r} is not supported: the experts are SwiGLU (silu)")
    if not 1 <= cfg.num_experts_per_tok <= cfg.num_experts:
        raise ValueError(f"num_experts_per_tok={cfg.num_experts_per_tok} must lie in [1, num_experts="
                         f"{cfg.num_experts}]")
    step = fields.decoder_sparse_step if family.dense_layers else 1
    if step < 1:
        raise ValueError(f"decoder_sparse_step={step} must be >= 1")
    dense = set(fields.mlp_only_layers or ()) if family.dense_layers else set()
    sparse = tuple(i not in dense and cfg.num_experts > 0 and (i + 1) % step == 0
                   for i in range(cfg.num_hidden_layers))  # as HF decides it
    renormalize = family.always_renormalize or bool(fields.norm_topk_prob)
    router = RouterSpec(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, renormalize=renormalize)
    shared = cfg.shared_expert_intermediate_size if family.shared_expert else 0
    block = partial(SparseMoeBlock, router, family.expert_size(cfg), shared)
    spec = llama_spec(cfg, fields)
    qkv_bias = family.reads_qkv_bias and bool(fields.qkv_bias)
    return replace(spec, qk_norm=family.qk_norm, qkv_bias=spec.qkv_bias or qkv_bias,
                   mlp=partial(_sparse_or_dense, sparse, block))


def _sparse_or_dense(sparse: tuple[bool, ...], block: Callable, spec: DecoderSpec, cfg, layer_idx: int,
                     expert_parallel_size: int) -> nn.Module:
    """Layer `layer_idx`'s MLP: the MoE block on a sparse layer, else Llama's dense MLP."""
    if sparse[layer_idx]:
        return block(cfg.hidden_size, expert_parallel_size)
    return dense_mlp(spec, cfg, layer_idx, expert_parallel_size)


class FloatGate(nn.Module):
    """A small projection computed in fp32 and never quantized: a shared expert's gate [T, 1].
    Parameter `weight [out, in]`."""

    def __init__(self, in_features: int, out_features: int):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(out_features, in_features))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.float(), self.weight.float())  # [T, out] fp32


class SparseMoeBlock(nn.Module):
    """Router `gate`, routed `experts` and (Qwen2-MoE) `shared_expert` with `shared_expert_gate`."""

    def __init__(self, router: RouterSpec, expert_size: int, shared_size: int, hidden: int,
                 expert_parallel_size: int = 1):
        super().__init__()
        self.gate = Router(router)
        E = router.num_experts
        self.experts: nn.Module = FusedExperts(E, hidden, expert_size, None, expert_parallel_size)
        self.shared_expert = SharedExpert(hidden, shared_size, None) if shared_size else None
        self.shared_expert_gate = FloatGate(hidden, 1) if shared_size else None
        self.computes_experts = computes_expert_slice(expert_parallel_size)
        self.split, self.adds_shared = tp_size() > 1, tp_rank() == 0  # fixed at construction

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        topk_ids, topk_weights = self.gate(x)  # [T, k] each
        out = self.experts(x, topk_ids, topk_weights) if self.computes_experts else torch.zeros_like(x)  # [T, H]
        if self.shared_expert is not None and self.adds_shared:
            gate = torch.sigmoid(self.shared_expert_gate(x)).to(x.dtype)  # [T, 1]
            out = out + gate * self.shared_expert(x)  # [T, H]
        return all_reduce(out) if self.split else out  # [T, H], summed over the ranks


class MoeForCausalLM(DecoderLM):
    """A Llama-family MoE model; `family` (a class attribute) says which. The decoder is
    models/decoder.py's with `moe_spec`; loading adds the routed experts."""

    # attention split over tensor-parallel ranks, routed experts over expert_parallel_size groups;
    # decode is not graph-safe: the torch expert hook reads expert counts back to the host;
    # linear layers and experts quantizable at load
    capabilities = ModelCapabilities(tensor_parallel=True, expert_parallel=True, quantize_at_load=True)
    family: MoeFamily = QWEN3_MOE

    @classmethod
    def decoder_spec(cls, cfg, expert_parallel_size: int = 1) -> DecoderSpec:
        return moe_spec(cfg, cls.family)

    def moe_blocks(self) -> list[SparseMoeBlock]:
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, SparseMoeBlock)]

    def bind_caches(self, caches) -> None:
        """Llama's binding, and the backend's kernel set (grouped_moe hook) and batch-invariant flag
        for the routed experts."""
        super().bind_caches(caches)
        for block in self.moe_blocks():
            if isinstance(block.experts, FusedExperts):
                block.experts.kernels = caches.backend.kernels
            block.experts.batch_invariant = caches.backend.batch_invariant

    def load_weights(self, weights) -> None:
        """HF, Mixtral or GGUF-derived names; experts go to their `FusedExperts`, which then keep
        their stacks or become `QuantFusedExperts` (all matrices packed); the rest is Llama's."""
        skip = ("lm_head.",) if self.tie_word_embeddings else ()
        loaded = load_weights(self, self._experts_loaded(weights), skip_prefixes=skip)
        for block in self.moe_blocks():
            block.experts = block.experts.finish_loading()  # checks every held expert arrived
        missing = {n for n, _ in self.named_parameters() if ".mlp.experts." not in n} - loaded
        if missing:
            raise ValueError(f"checkpoint lacks {len(missing)} parameters, e.g. {sorted(missing)[:3]}")

    def _experts_loaded(self, weights):
        """Every tensor but the routed experts' (copied into their module here, as they come); the
        fp32 gates are read whole and dequantized if the file packed them."""
        for name, tensor in weights:
            name = name.replace(".block_sparse_moe.", ".mlp.")
            expert, stacked = _EXPERT.match(name), _STACKED.match(name)
            if expert:
                self._experts(name, expert["owner"]).load_expert_weight(int(expert["expert"]), expert["proj"], tensor)
            elif stacked:
                self._experts(name, stacked["owner"]).load_stacked(stacked["proj"], tensor)
            else:
                yield name, _gate_value(self, name, tensor) if name.endswith(_GATES) else tensor

    def _experts(self, name: str, owner: str) -> FusedExperts:
        try:
            module = self.get_submodule(owner)
        except AttributeError:
            module = None
        if not isinstance(module, FusedExperts):
            raise ValueError(f"checkpoint tensor {name!r} has no matching experts in {type(self).__name__}")
        return module


def _gate_value(model: nn.Module, name: str, tensor) -> torch.Tensor:
    """A gate's weight as a dense tensor of its parameter's shape (GGUF may store [1, H] as [H])."""
    value = tensor if isinstance(tensor, torch.Tensor | QuantWeight) else tensor.read()
    value = dequantize_ref(value) if isinstance(value, QuantWeight) else value
    try:
        shape = model.get_parameter(name).shape
    except AttributeError:
        return value  # no such parameter: loading names it
    return value.reshape(shape) if value.numel() == shape.numel() else value


class Qwen3MoeForCausalLM(MoeForCausalLM):
    """HF `qwen3_moe`."""

    family = QWEN3_MOE


class Qwen2MoeForCausalLM(MoeForCausalLM):
    """HF `qwen2_moe`."""

    family = QWEN2_MOE


class MixtralForCausalLM(MoeForCausalLM):
    """HF `mixtral`."""

    family = MIXTRAL


__all__ = ["MixtralForCausalLM", "Qwen2MoeForCausalLM", "Qwen3MoeForCausalLM"]
