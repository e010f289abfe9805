"""The kernels' thread pool (ops/work_pool.cpp): the thread count it takes, the same bits on any count,
and calls from several Python threads at once (one runs on the pool, the others on their own thread)."""

from __future__ import annotations

import threading

import pytest
import torch

from deepinfer.model_executor.layers.ops import qdot as qd
from deepinfer.model_executor.layers.ops.cpu_kernels import kernel_isa, set_kernel_threads
from tests.ops.test_qdot import activations, random_blocks, run_qdot

pytestmark = pytest.mark.skipif(not kernel_isa(), reason="needs the CPU kernel library")


@pytest.fixture
def pool():
    before = torch.get_num_threads()
    yield
    set_kernel_threads(0)
    torch.set_num_threads(before)


def test_the_pool_takes_its_own_count_else_torchs(pool):
    torch.set_num_threads(1)
    set_kernel_threads(3)
    assert torch.ops.deepinfer_cpu.pool_threads() == 3
    set_kernel_threads(0)
    assert torch.ops.deepinfer_cpu.pool_threads() == 1
    torch.set_num_threads(2)
    assert torch.ops.deepinfer_cpu.pool_threads() == 2


@pytest.mark.parametrize("m", [1, 40])  # decode's own shares, then prefill's chunks
def test_any_thread_count_gives_the_same_bits(pool, m):
    w, x = random_blocks("Q4_K", 512, 512, seed=1), activations(m, 512, seed=2)
    isa = qd.qdot_isa()
    outs = []
    for n in (1, 2, 3, 7):
        set_kernel_threads(n)
        outs.append(run_qdot(x, w, isa))
    for out in outs[1:]:
        assert torch.equal(out, outs[0])


def test_calls_from_several_threads_at_once(pool):
    w, isa = random_blocks("Q8_0", 256, 512, seed=3), qd.qdot_isa()
    xs = [activations(8, 512, seed=s) for s in range(4)]
    set_kernel_threads(2)
    expected = [run_qdot(x, w, isa) for x in xs]
    got: dict[int, list[torch.Tensor]] = {}

    def worker(i: int) -> None:
        got[i] = [run_qdot(xs[i], w, isa) for _ in range(20)]

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i, outs in got.items():
        assert all(torch.equal(out, expected[i]) for out in outs)
