"""Tensor-parallel layers (layers/parallel_linear.py) in 2 gloo processes equal the unsplit torch
layers on the same full weights; the shard arithmetic and the start-up refusals on one rank."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp
import torch.nn.functional as F

from deepinfer.distributed.parallel_state import all_gather, destroy_parallel, init_parallel
from deepinfer.model_executor.layers import parallel_linear as pl

pytestmark = [pytest.mark.multirank]

WORLD = 2


def run_ranks(fn, tmp_path, *args) -> None:
    """fn(rank, *args) in WORLD spawned processes joined over gloo (a file:// rendezvous in tmp_path);
    an assertion failing in a rank fails the test with that rank's traceback."""
    mp.spawn(_rank_main, args=(fn, f"file://{tmp_path}/rendezvous", args), nprocs=WORLD, join=True)


def _rank_main(rank: int, fn, init_method: str, args) -> None:
    torch.set_num_threads(1)
    init_parallel(rank, WORLD, init_method, torch.device("cpu"))
    try:
        fn(rank, *args)
    finally:
        destroy_parallel()


def _loaded(module, leaf: str, full: torch.Tensor, index: int = 0) -> None:
    """Load piece `index` of `full` into module.<leaf> through its shard spec (a full tensor source)."""
    pl.shard_spec_of(module, leaf).load(getattr(module, leaf).data, index, full, leaf)


@torch.no_grad()
def _check_layers(rank: int, safetensors_path: str) -> None:
    torch.manual_seed(0)  # the same full weights on every rank
    x = torch.randn(5, 8)  # [T, in]
    _check_column(rank, x)
    _check_qkv_replicated_kv(rank, x)
    _check_row(rank)
    _check_vocab(rank)
    _check_lazy_slices(rank, safetensors_path)


def _check_column(rank: int, x: torch.Tensor) -> None:
    w, b = torch.randn(12, 8), torch.randn(12)  # [out, in], [out]
    layer = pl.ColumnParallelLinear(8, [pl.even_piece(12, "out")], bias=True)
    _loaded(layer, "weight", w)
    _loaded(layer, "bias", b)
    assert layer.weight.shape == (6, 8)
    torch.testing.assert_close(all_gather(layer(x), dim=-1), F.linear(x, w, b))  # [T, 12]


def _check_qkv_replicated_kv(rank: int, x: torch.Tensor) -> None:
    """4 query heads, 1 KV head, 2 ranks: each rank 2 query heads and a copy of the one KV head."""
    heads, kv_heads, d = 4, 1, 2
    q, kv = pl.head_pieces(heads, kv_heads, d)
    layer = pl.ColumnParallelLinear(8, [q, kv, kv], bias=False)
    assert layer.shard_sizes == [4, 2, 2]
    full = torch.randn((heads + 2 * kv_heads) * d, 8)  # [q|k|v, in]
    for i, piece in enumerate(full.split([heads * d, kv_heads * d, kv_heads * d])):
        _loaded(layer, "weight", piece, i)
    wq, wk, wv = full.split([heads * d, kv_heads * d, kv_heads * d])
    expected = torch.cat([wq[rank * 4:rank * 4 + 4], wk, wv])  # [8, in]: its heads' rows, the shared KV head
    torch.testing.assert_close(layer.weight, expected)
    torch.testing.assert_close(layer(x), F.linear(x, expected))


def _check_row(rank: int) -> None:
    w, b, x = torch.randn(6, 12), torch.randn(6), torch.randn(5, 12)  # [out, in], [out], [T, in]
    layer = pl.RowParallelLinear(12, 6, bias=True, what="in")
    _loaded(layer, "weight", w)
    layer.bias.copy_(b)  # held whole: added once, after the all_reduce
    assert pl.shard_spec_of(layer, "bias") is None and layer.weight.shape == (6, 6)
    y = layer(x[:, rank * 6:rank * 6 + 6])  # [T, out]: the rank's input slice
    torch.testing.assert_close(y, F.linear(x, w, b))


def _check_vocab(rank: int) -> None:
    """V = 11 over 2 ranks: 6 rows each, rank 1's last row is padding (zero, trimmed from logits)."""
    table, hidden = torch.randn(11, 4), torch.randn(3, 4)  # [V, E], [N, E]
    embed = pl.VocabParallelEmbedding(11, 4)
    _loaded(embed, "weight", table)
    assert embed.weight.shape == (6, 4) and embed.vocab_start == 6 * rank
    if rank == 1:
        assert torch.all(embed.weight[5] == 0)
    ids = torch.tensor([0, 5, 6, 10, 3])  # [T]: ids on both sides of the split
    torch.testing.assert_close(embed(ids), F.embedding(ids, table))  # [T, E]
    head = pl.vocab_parallel_head(4, 11)
    _loaded(head, "weight", table)
    logits = pl.gather_vocab_logits(F.linear(hidden, head.weight), 11)  # [N, V]
    torch.testing.assert_close(logits, F.linear(hidden, table))
    tied = pl.gather_vocab_logits(F.linear(hidden, embed.weight), 11)  # the tied head: the embedding's rows
    torch.testing.assert_close(tied, F.linear(hidden, table))


def _check_lazy_slices(rank: int, path: str) -> None:
    """A safetensors tensor loads through get_slice: a row slice (column-parallel), a column slice
    (row-parallel), each equal to the same slice of the full tensor."""
    from safetensors import safe_open

    from deepinfer.model_executor.loader.hf import SafetensorsSlice

    with safe_open(path, framework="pt") as f:
        full = f.get_tensor("w").float()  # [12, 8]
        column = pl.ColumnParallelLinear(8, [pl.even_piece(12, "out")], bias=False)
        _loaded(column, "weight", SafetensorsSlice(f.get_slice("w"), torch.float32))
        row = pl.RowParallelLinear(8, 12, bias=False, what="in")
        _loaded(row, "weight", SafetensorsSlice(f.get_slice("w"), torch.float32))
    torch.testing.assert_close(column.weight, full[rank * 6:rank * 6 + 6])
    torch.testing.assert_close(row.weight, full[:, rank * 4:rank * 4 + 4])


def test_parallel_layers_equal_unsplit_layers(tmp_path):
    from safetensors.torch import save_file

    path = str(tmp_path / "w.safetensors")
    save_file({"w": torch.randn(12, 8, dtype=torch.float16)}, path)  # cast to fp32 as it is read
    run_ranks(_check_layers, tmp_path, path)


# ---- one rank: the arithmetic and the refusals ---------------------------------------------------

def test_one_rank_specs_read_whole_tensors():
    assert pl.even_piece(12, "x") == pl.Piece(12, 0, 12, 12)
    assert pl.vocab_piece(11) == pl.Piece(11, 0, 11, 11)
    spec = pl.ShardSpec(0, (pl.Piece(4, 0, 4, 4), pl.Piece(2, 0, 2, 2)))
    full = torch.arange(12.0).view(6, 2)  # [6, 2]
    torch.testing.assert_close(spec.take(full), full)
    assert spec.full_shape(torch.Size([6, 2])) == (6, 2)


def test_shard_spec_take_pads_and_slices_each_piece():
    """Rank 1 of 2 pieces: rows 2..3 of piece 0, row 1 of piece 1 padded by one zero row."""
    spec = pl.ShardSpec(0, (pl.Piece(4, 2, 2, 2), pl.Piece(2, 1, 1, 2)))
    full = torch.arange(6.0).view(6, 1) + 1  # [6, 1]: pieces [1..4], [5, 6]
    assert spec.take(full).flatten().tolist() == [3.0, 4.0, 6.0, 0.0]
    with pytest.raises(ValueError, match="shape"):
        spec.load(torch.zeros(4, 1), 1, torch.zeros(3, 1), "w")


@pytest.mark.parametrize("heads, kv_heads, size, needle", [
    (4, 2, 3, "tensor_parallel_size=3 must divide num_attention_heads=4"),
    (12, 3, 2, "tensor_parallel_size=2 must divide num_key_value_heads=3"),
])
def test_bad_head_split_is_refused_naming_both_sizes(heads, kv_heads, size, needle):
    with pytest.raises(ValueError, match=needle):
        pl.check_head_split(heads, kv_heads, size)


@pytest.mark.parametrize("heads, kv_heads, size", [(8, 2, 4), (8, 2, 2), (8, 1, 8), (4, 2, 4)])
def test_good_head_splits_pass(heads, kv_heads, size):
    pl.check_head_split(heads, kv_heads, size)  # splits the KV heads, or replicates them
