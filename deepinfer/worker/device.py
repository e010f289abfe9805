"""The torch device a `device` setting names, or one line saying why it cannot be used.

    None / "auto"   cuda when a CUDA GPU is usable, else cpu
    "cpu"           the CPU
    "cuda", "cuda:N"  a CUDA GPU (N counts the GPUs this process sees: CUDA_VISIBLE_DEVICES)

Every refusal is a ValueError whose message names the value and the fix, so the CLI prints it as
one line; it is raised before any tensor is placed.
"""

from __future__ import annotations

import torch

SUPPORTED_DEVICES = "auto, cpu, cuda or cuda:N"


def resolve_device(name: str | None) -> torch.device:
    """The device `name` names; ValueError when it is malformed, not supported, or absent."""
    if name is None or name.strip().lower() == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(name.strip().lower())
    except (RuntimeError, ValueError):
        raise ValueError(f"device {name!r} is not a device: use {SUPPORTED_DEVICES}") from None
    if device.type == "cuda":
        check_cuda(name, device.index)
    elif device.type != "cpu":
        raise ValueError(f"device {name!r} ({device.type}) is not supported: use {SUPPORTED_DEVICES}")
    return device


def check_cuda(name: str, index: int | None) -> None:
    """ValueError unless this torch build has CUDA, a GPU is usable, and GPU `index` exists."""
    if torch.version.cuda is None:
        raise ValueError("CUDA requested but this torch build is CPU-only: use --device cpu or install a "
                         "CUDA build of torch")
    if not torch.cuda.is_available():
        raise ValueError(f"device {name!r}: no CUDA GPU is usable (torch.cuda.is_available() is False; check "
                         f"the driver and CUDA_VISIBLE_DEVICES): use --device cpu")
    count = torch.cuda.device_count()
    if index is not None and index >= count:
        raise ValueError(f"device {name!r}: this process sees {count} GPU{'s' if count != 1 else ''} "
                         f"(cuda:0 to cuda:{count - 1}): use one of them or --device cpu")


def set_cpu_threads(num_threads: int | None, world_size: int = 1) -> None:
    """This process's CPU threads for the model's kernels (torch's pool, which the C++ kernels' OpenMP
    shares): `num_threads` when given; else, for one of several ranks, an even share of torch's
    default (the ranks share the cores); else torch's default."""
    if num_threads is not None:
        torch.set_num_threads(num_threads)
    elif world_size > 1:
        torch.set_num_threads(max(1, torch.get_num_threads() // world_size))
