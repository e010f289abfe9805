"""QuantLinear's step path (the parts checked once per load, then the kernel calls alone) gives
qmatmul's bits, for one part and for merged parts of several types, and follows the parts when
their bytes are replaced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_level
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight, qmatmul
from deepinfer.model_executor.layers.quant_linear import QuantLinear

pytestmark = pytest.mark.skipif(not qdot_level(), reason="needs the CPU kernels: without them QuantLinear takes "
                                                          "qmatmul, which tests/ops/test_qmatmul.py covers")


def _weight(kind: str, n: int, k: int, seed: int) -> QuantWeight:
    """Random codes and scales with finite fp16 scale fields (Q8_0: d first; Q4_K: d, dmin first)."""
    block_values, block_bytes = {"Q8_0": (32, 34), "Q4_K": (256, 144)}[kind]
    rng = np.random.default_rng(seed)
    data = rng.integers(0, 256, (n, k // block_values, block_bytes), dtype=np.uint8)
    halves = 2 if kind == "Q4_K" else 1
    scales = (rng.standard_normal((n, k // block_values, halves)) * 0.01).astype(np.float16)
    data[..., : 2 * halves] = scales.view(np.uint8).reshape(n, k // block_values, 2 * halves)
    return QuantWeight(torch.from_numpy(data.reshape(n, -1)), kind)


@pytest.mark.parametrize("kind,levels", [("Q4_K", 1), ("Q4_K", 2), ("Q8_0", 1)])
def test_the_step_path_has_qmatmuls_bits(kind, levels):
    w = _weight(kind, 40, 512, seed=1)
    layer = QuantLinear(w, torch.randn(40), act_levels=levels)
    for rows in (1, 3, 9):  # one row, few rows, many
        x = torch.randn(rows, 512)
        assert torch.equal(layer(x), qmatmul(x, (w,), levels) + layer.bias)
    assert layer._checked is not None and layer._checked[1] is not None  # the step path ran
    x3 = torch.randn(2, 3, 512)  # not [M, K]: the general path
    assert torch.equal(layer(x3), qmatmul(x3, (w,), levels) + layer.bias)


def test_the_step_path_follows_replaced_bytes_and_takes_merged_parts():
    first, second = _weight("Q4_K", 16, 256, seed=2), _weight("Q4_K", 16, 256, seed=3)
    layer = QuantLinear(first, None, act_levels=1)
    x = torch.randn(1, 256)
    before = layer(x)
    layer.qweights = (second,)
    after = layer(x)
    assert torch.equal(after, qmatmul(x, (second,), 1)) and not torch.equal(after, before)
    merged = QuantLinear((first, _weight("Q8_0", 8, 256, seed=4)), None, act_levels=1)
    for rows, levels in ((1, 1), (1, 2), (9, 2)):  # one activation quantization for both parts
        merged.act_levels = levels
        x = torch.randn(rows, 256)
        assert torch.equal(merged(x), qmatmul(x, merged.qweights, levels))
    assert len(merged._checked[1]) == 2
