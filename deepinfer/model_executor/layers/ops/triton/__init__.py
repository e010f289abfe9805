"""Triton kernels of the GPU path. Without CUDA they run under the Triton interpreter
(TRITON_INTERPRET=1 is set here, before triton is first imported), so CPU tests exercise them.

Kernel modules take `triton` and `tl` from this package (None when triton is missing);
`triton_available()` says whether kernels can run, `PIP_HINT` names the fix when they cannot.
"""

from __future__ import annotations

import os
import sys

import torch

PIP_HINT = "pip install triton"


def interpreted() -> bool:
    """True when kernels run under the Triton interpreter (no CUDA, or TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def _interpret_language() -> None:
    """Rebuild triton.language's own @jit helpers (tl.zeros, tl.max, tl.sum, ...) as interpreted
    functions. torch imports triton early (torch._dynamo probes for it), possibly before
    TRITON_INTERPRET is set here; those helpers were then built for the compiler, and an
    interpreted kernel that calls one fails ("Cannot call @triton.jit'd outside of the scope of a
    kernel")."""
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    for name, module in list(sys.modules.items()):
        if module is not None and (name == "triton.language" or name.startswith("triton.language.")):
            for attr, value in list(vars(module).items()):
                if isinstance(value, JITFunction):
                    setattr(module, attr, InterpretedFunction(value.fn))


_imported_before = "triton" in sys.modules
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

try:
    import triton
    import triton.language as tl
except ImportError:
    triton = tl = None
if triton is not None and not hasattr(triton, "jit"):  # a directory named triton on sys.path, not the package
    triton = tl = None
if triton is not None and _imported_before and interpreted():
    _interpret_language()


def triton_available() -> bool:
    """True when triton imports (interpreted without CUDA)."""
    return triton is not None
