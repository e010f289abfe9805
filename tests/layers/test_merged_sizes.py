"""What the loaders read off linear modules as declared attributes: the rows of a merged projection's
pieces (`merged_sizes`) and the packed weights of the quantized modules (`packed_weights`)."""

from __future__ import annotations

import torch
from torch import nn

from deepinfer.model_executor.layers.fused_moe import QuantFusedExperts
from deepinfer.model_executor.layers.ops.qmatmul import quantize_weight
from deepinfer.model_executor.layers.parallel_linear import ColumnParallelLinear, MergedLinear, Piece
from deepinfer.model_executor.layers.quant_linear import QuantEmbedding, QuantLinear, merged_sizes, packed_weights


def _q8(rows: int, cols: int = 32):
    return quantize_weight(torch.randn(rows, cols), "int8")


def test_merged_sizes_of_merged_modules_only():
    assert merged_sizes(MergedLinear(32, [8, 4, 4], bias=False)) == [8, 4, 4]
    assert merged_sizes(ColumnParallelLinear(32, [Piece(8, 0, 8, 8), Piece(4, 0, 4, 4)], bias=True)) == [8, 4]
    assert merged_sizes(nn.Linear(32, 16)) is None
    assert merged_sizes(nn.Embedding(16, 32)) is None
    assert merged_sizes(QuantLinear(_q8(16), None)) is None
    assert merged_sizes(QuantLinear([_q8(12), _q8(4)], None, [12, 4])) == [12, 4]


def test_packed_weights_lists_every_quantized_module_part():
    linear, table = QuantLinear([_q8(12), _q8(4)], None, [12, 4]), QuantEmbedding(_q8(10))
    experts = QuantFusedExperts(2, None, 1, [(_q8(8),), (_q8(8),)], [_q8(32, 4 * 32) for _ in range(2)])
    model = nn.ModuleDict({"linear": linear, "table": table, "experts": experts, "plain": nn.Linear(32, 8)})
    got = packed_weights(model)
    assert [id(w) for w in got] == [id(w) for w in (*linear.qweights, table.qweight, *experts.qweights)]
    assert len(got) == 2 + 1 + 4
