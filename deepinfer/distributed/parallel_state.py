"""Who this process is among the ranks of a tensor-parallel run, and the collectives the parallel
layers call.

One process per rank; all ranks form one tensor-parallel group (gloo on the CPU, NCCL on CUDA).
With one rank (the default) every collective returns its input and torch.distributed is never
initialised, so single-device code pays nothing.
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

_WORLD = {"rank": 0, "size": 1}


def backend_for(device: torch.device) -> str:
    """The collective backend of a device type: NCCL for CUDA, gloo otherwise."""
    return "nccl" if device.type == "cuda" else "gloo"


def init_parallel(rank: int, world_size: int, init_method: str, device: torch.device) -> None:
    """Join the tensor-parallel group as `rank` of `world_size` (a no-op for one rank)."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank must lie in [0, {world_size}), got {rank}")
    _WORLD.update(rank=rank, size=world_size)
    if world_size > 1 and not dist.is_initialized():
        dist.init_process_group(backend_for(device), init_method=init_method, rank=rank, world_size=world_size)


def check_no_group() -> None:
    """RuntimeError when this process is still in a tensor-parallel group: one multi-rank engine
    at a time per process (an earlier one must be closed, or dropped and garbage collected)."""
    if dist.is_initialized():
        raise RuntimeError(f"this process is still in a process group (rank {dist.get_rank()} of "
                           f"{dist.get_world_size()}): is another engine with tensor_parallel_size > 1 open? "
                           f"Close it first (llm.close(), or `with LLM(...) as llm:`)")


def destroy_parallel() -> None:
    """Leave the group (back to one rank; idempotent)."""
    if dist.is_initialized():
        dist.destroy_process_group()
    _WORLD.update(rank=0, size=1)


@contextlib.contextmanager
def as_rank(rank: int, world_size: int):
    """Inside it, this process reads tp_rank() == rank of tp_size() == world_size without joining a
    group: for building one rank's model (on the meta device) to read its shapes. Construction runs
    no collective; nothing inside may run one."""
    saved = dict(_WORLD)
    _WORLD.update(rank=rank, size=world_size)
    try:
        yield
    finally:
        _WORLD.update(saved)


def tp_rank() -> int:
    return _WORLD["rank"]


def tp_size() -> int:
    return _WORLD["size"]


def all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the ranks, in place (x itself with one rank)."""
    if tp_size() > 1:
        dist.all_reduce(x)
    return x


def all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Every rank's `x`, concatenated along `dim` in rank order ([..., n, ...] -> [..., n*world, ...])."""
    if tp_size() == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(tp_size())]
    dist.all_gather(parts, x.contiguous())
    return torch.cat(parts, dim=dim)


def broadcast_object(obj=None, src: int = 0):
    """`obj` from rank `src` on every rank (pickled; for step plans, not tensors)."""
    if tp_size() == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src)
    return box[0]
