"""Which threads a CPU step runs on: the C++ kernels' pool, and torch's own ops.

The integer matmuls, attention, norms and RoPE run on the kernels' pool (`ops/work_pool.cpp`), whose
calls never wait for a thread that took no work. torch's own ops (embedding lookups, adds, the
sampler's row ops) run on torch's OpenMP team, which waits at the end of every parallel region for
each of its threads, and whose threads spin after each region. When the model's matmuls are the
kernels' (quantized weights), those ops are small: run on the step's thread alone they cost little,
where a team of N costs a barrier per op and spinning threads that take the cores from the kernels'
pool (measured with two busy loops on a 2-core machine: batch-1 decode at a third of its speed, and
slower than one thread). With dense weights the matmuls are torch's, so torch keeps the N threads.

torch's thread count is per calling thread under OpenMP (a server's engine thread starts at the
default, not at the main thread's `torch.set_num_threads`), so the count is set in whichever thread
runs the step, for the step, and the caller's count is put back after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

from deepinfer.contracts.numerics import NumericsRecord
from deepinfer.model_executor.layers.ops.cpu_kernels import set_kernel_threads

_KERNEL_QUANTIZATIONS = ("gguf", "int8", "int4")  # matmuls on the integer kernels


class StepThreads:
    """Thread counts while a step runs (`with threads.step(): ...`): the kernels' pool takes the
    engine's count, torch's ops `torch_threads` in the calling thread; both put back after."""

    def __init__(self, pool_threads: int | None, torch_threads: int | None):
        self.pool_threads, self.torch_threads = pool_threads, torch_threads  # None: leave it alone

    @classmethod
    def for_numerics(cls, record: NumericsRecord, threads: int) -> StepThreads:
        """On a CPU: the pool on `threads`; torch on one thread when the matmuls are the pool's, else on
        `threads`."""
        if record.device_type != "cpu":
            return cls(None, None)
        on_kernels = record.kernel_isa != "none" and record.quantization in _KERNEL_QUANTIZATIONS
        return cls(threads, 1 if on_kernels else threads)

    @contextlib.contextmanager
    def step(self) -> Iterator[None]:
        if self.pool_threads is None:
            yield
            return
        before = torch.get_num_threads()
        set_kernel_threads(self.pool_threads)
        torch.set_num_threads(self.torch_threads)
        try:
            yield
        finally:
            torch.set_num_threads(before)
            set_kernel_threads(0)  # calls outside steps follow torch's count again
