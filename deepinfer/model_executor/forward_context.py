"""Per-step metadata for the layers, set by a context manager that forbids nesting.

The runner enters `forward_context(metadata)` around one model call; attention layers read
`get_forward_context()`. The context always resets, even when the forward raises.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Any


@dataclass
class ForwardContext:
    attn_metadata: Any  # the attention backend's metadata for this step


_current: ForwardContext | None = None


@contextlib.contextmanager
def forward_context(attn_metadata):
    global _current
    if _current is not None:
        raise RuntimeError("forward_context is already active: nested model calls are not allowed")
    _current = ForwardContext(attn_metadata)
    try:
        yield _current
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    if _current is None:
        raise RuntimeError("no forward_context is active: call the model through the ModelRunner")
    return _current
