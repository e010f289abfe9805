"""Fixtures of the kernel tests."""

import pytest

from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa


@pytest.fixture
def isa_env(monkeypatch):
    """Set DEEPINFER_CPU_ISA for one test; the process's choice is read again before and after."""
    def set_isa(value: str) -> None:
        monkeypatch.setenv("DEEPINFER_CPU_ISA", value)
        kernel_isa.cache_clear()

    yield set_isa
    monkeypatch.undo()
    kernel_isa.cache_clear()
