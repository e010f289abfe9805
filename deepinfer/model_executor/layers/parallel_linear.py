"""Tensor-parallel layers in the Megatron layout, and the shard spec that loading and dummy weights read.

Rank r of n holds a slice of each large weight; one all_reduce closes an attention block and one an MLP:

    ColumnParallelLinear    W [out, in] split on out, per merged piece (q|k|v, gate|up):
                            y_r = x W_r^T + b_r, [T, out_r]; no collective
    RowParallelLinear       W split on in: y = all_reduce(x_r W_r^T) + b, the bias added once
    VocabParallelEmbedding  rows [r*Vp, r*Vp + Vp) of the [V, E] table, Vp = ceil(V / n); the last
                            slice is padded with zero rows; ids outside the slice give zeros,
                            and an all_reduce sums the ranks' rows
    vocab_parallel_head     an LM head [Vp, E] on the same rows; gather_vocab_logits all-gathers
                            the [N, Vp] slices and trims the padding: [N, V] on every rank

A module that is split carries `shard_specs` ({"weight": ShardSpec, "bias": ...}), a plain
attribute, so it survives a class swap (linear.FewRowLinear). A ShardSpec names the split dim and,
for each merged piece, which indices of the full (one-rank) piece this rank reads:

    full piece i   [ ............ full ............ ]
    rank r reads            [start, start + length)
    local rows     [ length | zero padding ] = local

With one rank every spec reads the whole tensor and the layers are the unsplit ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.distributed.parallel_state import all_gather, all_reduce, tp_rank, tp_size
from deepinfer.model_executor.layers.ops.qmatmul import QuantWeight


@dataclass(frozen=True)
class Piece:
    """One merged piece along the split dim: its full size, the rank's [start, start+length), local rows."""

    full: int
    start: int
    length: int
    local: int


@dataclass(frozen=True)
class ShardSpec:
    """Which slice of a full parameter this rank holds: pieces laid end to end along `dim`."""

    dim: int
    pieces: tuple[Piece, ...]

    def full_shape(self, local_shape: torch.Size) -> tuple[int, ...]:
        shape = list(local_shape)
        shape[self.dim] = sum(p.full for p in self.pieces)
        return tuple(shape)

    def local_offset(self, index: int) -> int:
        return sum(p.local for p in self.pieces[:index])

    def take(self, full: torch.Tensor) -> torch.Tensor:
        """The rank's local tensor from the full one (all pieces, padded)."""
        parts = full.split([p.full for p in self.pieces], dim=self.dim)
        return torch.cat([_padded(part.narrow(self.dim, p.start, p.length), self.dim, p.local)
                          for part, p in zip(parts, self.pieces, strict=True)], dim=self.dim)

    def read(self, index: int, src, name: str, local_shape) -> torch.Tensor | QuantWeight:
        """Piece `index` of checkpoint tensor `src` (a tensor, a QuantWeight, or a lazy slice with .shape
        and .narrow) as the rank holds it: its slice, zero-padded to the local size. Only the slice is read."""
        piece = self.pieces[index]
        expected = list(local_shape)
        expected[self.dim] = piece.full
        if list(src.shape) != expected:
            raise ValueError(f"checkpoint tensor {name!r} has shape {tuple(src.shape)}, expected {tuple(expected)}")
        return _padded(src.narrow(self.dim, piece.start, piece.length), self.dim, piece.local)

    def load(self, dst: torch.Tensor, index: int, src, name: str) -> None:
        """Copy piece `index` of `src` (see `read`) into its rows of the local parameter `dst`."""
        self.local(dst, index).copy_(self.read(index, src, name, dst.shape))

    def local(self, dst: torch.Tensor, index: int) -> torch.Tensor:
        """The rows (or columns) of local parameter `dst` that hold piece `index`: a view."""
        return dst.narrow(self.dim, self.local_offset(index), self.pieces[index].local)


def _padded(x: torch.Tensor | QuantWeight, dim: int, size: int) -> torch.Tensor | QuantWeight:
    if x.shape[dim] == size:
        return x
    if isinstance(x, QuantWeight):  # only vocabulary rows are padded
        return x.padded_rows(size)
    shape = list(x.shape)
    shape[dim] = size - x.shape[dim]
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


def shard_spec_of(module: nn.Module, leaf: str) -> ShardSpec | None:
    """The module's spec for its parameter `leaf` ("weight", "bias"); None: held whole."""
    return getattr(module, "shard_specs", {}).get(leaf)


# ---- how sizes split -------------------------------------------------------------------------------

def even_piece(full: int, what: str) -> Piece:
    """This rank's equal share of `full` (ValueError naming `what` when n does not divide it)."""
    n = tp_size()
    if full % n:
        raise ValueError(f"tensor_parallel_size={n} must divide {what}={full}")
    share = full // n
    return Piece(full, tp_rank() * share, share, share)


def vocab_piece(vocab_size: int) -> Piece:
    """Rows [r*Vp, r*Vp + Vp) clipped to the vocabulary, Vp = ceil(V / n); the rest is padding."""
    per_rank = -(-vocab_size // tp_size())
    start = min(tp_rank() * per_rank, vocab_size)
    return Piece(vocab_size, start, min(vocab_size, start + per_rank) - start, per_rank)


def check_head_split(num_heads: int, num_kv_heads: int, size: int) -> None:
    """Refuse a split of attention heads that does not work, naming both sizes: n must divide the
    query heads, and either divide the KV heads or be a multiple of them (KV heads replicated)."""
    if num_heads % size:
        raise ValueError(f"tensor_parallel_size={size} must divide num_attention_heads={num_heads}")
    if num_kv_heads % size and size % num_kv_heads:
        raise ValueError(f"tensor_parallel_size={size} must divide num_key_value_heads={num_kv_heads} "
                         f"or be a multiple of it")


def head_pieces(num_heads: int, num_kv_heads: int, head_dim: int) -> tuple[Piece, Piece]:
    """(query piece, key/value piece) of a q|k|v projection: the rank's query heads, and the KV
    heads they read: an equal share when n divides the KV heads, else the one KV head of its group."""
    n, r = tp_size(), tp_rank()
    check_head_split(num_heads, num_kv_heads, n)
    q = even_piece(num_heads * head_dim, "num_attention_heads * head_dim")
    if num_kv_heads % n == 0:
        return q, even_piece(num_kv_heads * head_dim, "num_key_value_heads * head_dim")
    kv_head = r * num_kv_heads // n  # replicated: n / num_kv_heads ranks share each KV head
    return q, Piece(num_kv_heads * head_dim, kv_head * head_dim, head_dim, head_dim)


# ---- layers --------------------------------------------------------------------------------------

class MergedLinear(nn.Linear):
    """One Linear holding several HF projections stacked on the output axis, each whole on every rank."""

    def __init__(self, in_features: int, shard_sizes: list[int], bias: bool):
        super().__init__(in_features, sum(shard_sizes), bias=bias)
        self.shard_sizes = list(shard_sizes)


class ColumnParallelLinear(nn.Linear):
    """Output features split per piece; `shard_sizes` are the local piece sizes (split as q|k|v).
    With one rank it is a MergedLinear: every piece whole."""

    def __init__(self, in_features: int, pieces: list[Piece], bias: bool):
        super().__init__(in_features, sum(p.local for p in pieces), bias=bias)
        self.shard_sizes = [p.local for p in pieces]
        spec = ShardSpec(0, tuple(pieces))
        self.shard_specs = {"weight": spec, "bias": spec} if bias else {"weight": spec}


class RowParallelLinear(nn.Linear):
    """Input features split: each rank multiplies its slice, one all_reduce sums, the bias comes after."""

    def __init__(self, in_features: int, out_features: int, bias: bool, what: str):
        piece = even_piece(in_features, what)
        super().__init__(piece.local, out_features, bias=bias)
        self.shard_specs = {"weight": ShardSpec(1, (piece,))}

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = all_reduce(F.linear(x, self.weight))  # [T, out], summed over ranks
        return y if self.bias is None else y + self.bias  # [T, out]


class VocabParallelEmbedding(nn.Embedding):
    """The rank's rows of the table; ids outside them give zero rows before the all_reduce."""

    def __init__(self, vocab_size: int, embedding_dim: int):
        piece = vocab_piece(vocab_size)
        super().__init__(piece.local, embedding_dim)
        self.vocab_start, self.vocab_rows = piece.start, piece.length
        self.shard_specs = {"weight": ShardSpec(0, (piece,))}

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.vocab_start  # [T]
        inside = (local >= 0) & (local < self.vocab_rows)  # [T]
        rows = F.embedding(torch.where(inside, local, 0), self.weight)  # [T, E]
        return all_reduce(rows.masked_fill(~inside.unsqueeze(-1), 0.0))  # [T, E]


# ---- builders: the unsplit layers with one rank --------------------------------------------------

def row_parallel_linear(in_features: int, out_features: int, bias: bool, what: str) -> nn.Linear:
    """A RowParallelLinear, or a plain nn.Linear with one rank (linear.FewRowLinear may take it)."""
    if tp_size() == 1:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, what)


def vocab_parallel_embedding(vocab_size: int, embedding_dim: int) -> nn.Embedding:
    if tp_size() == 1:
        return nn.Embedding(vocab_size, embedding_dim)
    return VocabParallelEmbedding(vocab_size, embedding_dim)


def vocab_parallel_head(hidden_size: int, vocab_size: int) -> nn.Linear:
    """An untied LM head [Vp, hidden] on the rank's vocabulary rows (a plain head with one rank)."""
    piece = vocab_piece(vocab_size)
    head = nn.Linear(hidden_size, piece.local, bias=False)
    if tp_size() > 1:
        head.shard_specs = {"weight": ShardSpec(0, (piece,))}
    return head


def gather_vocab_logits(logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, Vp] slices of every rank -> [N, V] on every rank (a collective: all ranks call it). Logits
    of a head that holds the whole vocabulary (a model built for one rank) are returned as they are,
    whatever group this process has joined since."""
    if logits.shape[-1] >= vocab_size:
        return logits
    return all_gather(logits, dim=-1)[..., :vocab_size]  # [N, V]


# ---- expert parallelism: routed experts split over the ranks -------------------------------------

def check_expert_split(num_experts: int, expert_parallel_size: int) -> None:
    """Refuse an expert split that does not work, naming the sizes: 1 <= ep <= n, ep divides n and
    the routed experts."""
    n, ep = tp_size(), expert_parallel_size
    if ep < 1 or ep > n or n % ep:
        raise ValueError(f"expert_parallel_size={ep} must divide tensor_parallel_size={n} (1 <= ep <= tp)")
    if num_experts % ep:
        raise ValueError(f"n_routed_experts={num_experts} is not divisible by expert_parallel_size={ep}")


def expert_piece(num_experts: int, expert_parallel_size: int) -> Piece:
    """The rank's contiguous slice of the routed experts: slice s = rank // (n / ep) of ep equal
    slices; the n / ep ranks of one slice hold it alike."""
    check_expert_split(num_experts, expert_parallel_size)
    share = num_experts // expert_parallel_size
    start = tp_rank() // (tp_size() // expert_parallel_size) * share
    return Piece(num_experts, start, share, share)


def computes_expert_slice(expert_parallel_size: int) -> bool:
    """Whether this rank's routed-expert output counts: the first rank of each slice computes it,
    the other n / ep - 1 holders add nothing, so the all_reduce counts every slice once."""
    return tp_rank() % (tp_size() // expert_parallel_size) == 0
