"""`--load-format dummy`: a model built from its config alone, with seeded random weights.

For benchmarks and memory figures of models whose weights are not at hand (no *.safetensors
needed). The values are small and deterministic, chosen so that a forward pass stays finite:

    matrices and other float parameters   normal(0, 0.02)
    norm weights                          1 (the effective scale: 1 - the norm's offset is stored)
    biases, e_score_correction_bias       0
    hyper-connection scales (scale, hc_scale)   1
    tid2eid [vocab, k] (hash routers)     k distinct random expert ids per token in [0, E)

Every value comes from one CPU generator seeded with `seed`, drawn parameter by parameter in
`named_parameters()` order, so the weights are the same on every device and in every run. A
parameter split over tensor-parallel ranks (`shard_specs`) is drawn at its full one-rank shape and
sliced, so each rank holds its slice of the very tensor one rank would have.
"""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.parallel_linear import shard_spec_of
from deepinfer.model_executor.layers.router import Router

DUMMY_SEED = 0
DUMMY_STD = 0.02
_ONE_NAMES = ("scale", "hc_scale")
_ZERO_NAMES = ("bias", "e_score_correction_bias")


@torch.no_grad()
def init_dummy_weights(model: nn.Module, seed: int = DUMMY_SEED, std: float = DUMMY_STD) -> nn.Module:
    """Fill every parameter of `model` in place (see the module docstring); returns the model."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    for full_name, param in model.named_parameters():
        owner_name, _, name = full_name.rpartition(".")
        owner = model.get_submodule(owner_name) if owner_name else model
        value = _dummy_value(owner, name, param, gen, std)
        if value is not None:
            param.copy_(value)
    return model


def _dummy_value(owner: nn.Module, name: str, param: torch.Tensor, gen: torch.Generator, std: float):
    """The parameter's dummy value on the CPU (None: filled in place on the CPU already)."""
    if not param.is_floating_point():
        if name == "tid2eid":
            return _distinct_expert_ids(param.shape, _num_experts(owner, param), gen)
        return torch.zeros(param.shape, dtype=param.dtype)
    if name in _ZERO_NAMES:
        return torch.zeros(param.shape, dtype=param.dtype)
    if name in _ONE_NAMES:
        return torch.ones(param.shape, dtype=param.dtype)
    if name == "weight" and param.dim() == 1:  # a norm's weight: unit effective scale
        offset = owner.offset if isinstance(owner, RMSNorm) else 0.0  # Gemma's norms store w with offset 1
        return torch.full(param.shape, 1.0 - float(offset or 0.0), dtype=param.dtype)
    spec = shard_spec_of(owner, name)
    if spec is not None:  # the rank's slice of the full draw
        return spec.take(torch.empty(spec.full_shape(param.shape), dtype=param.dtype).normal_(0.0, std, generator=gen))
    if param.device.type == "cpu":
        param.normal_(0.0, std, generator=gen)
        return None
    return torch.empty(param.shape, dtype=param.dtype).normal_(0.0, std, generator=gen)


def _num_experts(owner: nn.Module, param: torch.Tensor) -> int:
    num = owner.num_experts if isinstance(owner, Router) else None  # the hash layer's router
    if not isinstance(num, int) or num < param.shape[-1]:
        raise ValueError(f"tid2eid of shape {tuple(param.shape)} needs its router's num_experts >= "
                         f"{param.shape[-1]}, got {num!r}")
    return num


def _distinct_expert_ids(shape: torch.Size, num_experts: int, gen: torch.Generator) -> torch.Tensor:
    """[vocab, k] ids: each row holds k distinct experts drawn uniformly from [0, num_experts)."""
    vocab, k = shape
    return torch.rand(vocab, num_experts, generator=gen).argsort(dim=1)[:, :k]  # [vocab, k] int64
