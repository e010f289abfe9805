"""The CPU kernel library (`qmatmul_cpu.cpp`, `fused_cpu.cpp`): built once with `torch.utils.cpp_extension` (the
system's g++ and ninja), cached under torch's extension directory (`TORCH_EXTENSIONS_DIR`, default
`~/.cache/torch_extensions`), and loaded on first use.

`make run` / `make test` build it at install time (`python -m deepinfer.model_executor.layers.ops.cpu_kernels`);
a process that finds no build builds it then (tens of seconds). Where it cannot be built (no
compiler, no AVX2) `kernel_isa()` is 0 and callers use their plain-torch paths; the reason is
logged once and kept in `kernel_status()`.

`DEEPINFER_CPU_ISA` (`avx512`, `avx2`, `none`; read once per process) caps the instruction set the
kernels use, e.g. to run the AVX2 path on an AVX-512 machine, or none at all.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import sys

import torch

logger = logging.getLogger("deepinfer.kernels")

_SOURCES = [os.path.join(os.path.dirname(__file__), name) for name in ("qmatmul_cpu.cpp", "fused_cpu.cpp")]
_ISA_NAMES = {0: "none", 1: "avx2", 2: "avx512"}
# -fno-trapping-math: nothing here reads floating-point exception flags, and it lets the compiler
# vectorize loops with selects (fused_cpu.cpp's exp).
_CFLAGS = ["-O3", "-fopenmp", "-DNDEBUG", "-fno-trapping-math"]


@functools.cache
def _load() -> tuple[int, str]:
    """(isa the library can run here, status line); builds the library if needed."""
    try:
        from torch.utils import cpp_extension

        digest = hashlib.sha256((torch.__version__ + " ".join(_CFLAGS)).encode())
        for source in _SOURCES:
            with open(source, "rb") as f:
                digest.update(f.read())
        cpp_extension.load(name=f"deepinfer_cpu_{digest.hexdigest()[:12]}", sources=_SOURCES, extra_cflags=_CFLAGS,
                           extra_ldflags=["-fopenmp"], is_python_module=False, verbose=False)
        isa = int(torch.ops.deepinfer_cpu.cpu_isa())
    except Exception as exc:  # no compiler, no ninja, a failed build: the torch paths still work
        status = f"CPU kernels unavailable ({type(exc).__name__}: {str(exc).strip().splitlines()[-1][:200]})"
        logger.warning("%s; quantized weights use the plain-torch path", status)
        return 0, status
    return isa, f"CPU kernels built for this CPU: {_ISA_NAMES[isa]}"


def _isa_cap() -> int:
    name = os.environ.get("DEEPINFER_CPU_ISA", "avx512").strip().lower()
    caps = {v: k for k, v in _ISA_NAMES.items()}
    if name not in caps:
        raise ValueError(f"DEEPINFER_CPU_ISA must be one of {', '.join(caps)}; got {name!r}")
    return caps[name]


@functools.cache
def kernel_isa() -> int:
    """The instruction set the quantized kernels use: 2 AVX-512, 1 AVX2, 0 none (plain torch).

    Decided once per process (`kernel_isa.cache_clear()` makes the next call read
    DEEPINFER_CPU_ISA again)."""
    cap = _isa_cap()
    return 0 if cap == 0 else min(_load()[0], cap)


def kernel_isa_name() -> str:
    return _ISA_NAMES[kernel_isa()]


def kernel_status() -> str:
    """One line: what was built and what runs (for `deepinfer info` and logs)."""
    isa, status = _load() if _isa_cap() else (0, "CPU kernels off (DEEPINFER_CPU_ISA=none)")
    return status if kernel_isa() == isa else f"{status}; capped to {kernel_isa_name()} by DEEPINFER_CPU_ISA"


def main() -> int:
    """Build the library now (the Makefile's install step); exit status 0 even without one."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    print(kernel_status())
    return 0


if __name__ == "__main__":
    sys.exit(main())
