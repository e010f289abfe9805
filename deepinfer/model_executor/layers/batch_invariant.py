"""Batch-invariant mode (`DEEPINFER_BATCH_INVARIANT`): a request's logprobs and seeded samples
are bit-identical whatever else shares its batch, however its prompt is chunked and whether its
prefix came from the cache. On the CPU it is the default (below: "The CPU default"); elsewhere
(a GPU, the Triton backend) it is off unless DEEPINFER_BATCH_INVARIANT=1.

A float sum's value depends on its order, so an op is invariant when the order in which each
output element is accumulated depends on that element's own inputs only, never on how many rows
share the call, where the row sits in it, or how the work is split across threads. Measured on
the CPU (an AMD EPYC with AVX-512, torch 2.13 with MKL and oneDNN, 2 threads;
tests/models/test_batch_invariant.py repeats the checks), and what this module does about each:

- Linear layers (`F.linear`). MKL's sgemm (torch's fp32 default) takes other kernels for calls
  of 1 .. 3 rows and for the last M mod 4 rows of small calls (M < 12, and M = 129 for the LM
  head): those rows differ in the last bits from the same row in a larger call, and batch-1
  decode (M = 1) is exactly such a call. oneDNN's linear (`mkldnn._linear_pointwise`, the dense
  weight, no copy) gives a row the same bits at any position of any call of M >= 2 rows
  (every M = 2 .. 699 and spot checks to 4199, fp32 and bf16); one row takes a GEMV kernel.
  `linear` runs oneDNN and gives a lone row a zero companion row. On SmolLM2's projections it is
  also faster than MKL at 1 .. 32 rows (2 rows: 26 ms per token's 120 layer matmuls, MKL's GEMV
  40 ms) and 7% slower at 512.
  Off the CPU it falls back to F.linear on rows padded to a multiple of 4 (MKL's rule; unverified
  for other BLAS).
- Reductions. torch splits a reduction across threads only when it has a single output element
  and >= 32768 inputs (a [1, V] sum over the vocabulary), otherwise it splits over output rows
  and every row is reduced by the same serial loop. `row_sum` reduces fixed blocks of
  `VOCAB_BLOCK` first, so no call has a single output element. RMSNorm, softmax, amax, topk and
  cumsum over rows are invariant as they are.
- Elementwise ops. A vectorized loop handles an array's tail (and each thread's chunk tail) with
  the scalar function: for `exp`, `log`, `tanh`, `erf`, `rsqrt` and plain arithmetic both give
  the same bits, for `silu`, `sigmoid` and `gelu` they do not (the same value rounds differently
  at the end of an array). `silu`, `sigmoid` and `gelu` here are written with `exp` / `tanh` /
  `erf` and IEEE arithmetic, `softplus` with `exp` and `log1p` (`sin`, `cos`, `log1p`, `sqrt` and
  `relu` keep their bits too).
- Attention. Every query reduces over its visible keys in blocks of `KEY_BLOCK` at absolute
  position offsets, from the block of its first visible key (`invariant_attention.py` holds that
  math; attention/invariant.py lays the blocks out; on the CPU kernel set invariant_cpu.cpp does
  the same in C++).
- The sampler (`Sampler(batch_invariant=True)`) takes its two vocabulary sums (logsumexp, top-p
  mass) through `row_sum`; its other stages (argmax, topk, per-block sums, float64 prefix sums,
  per-request generators) depend on the row alone.
- DeepSeek-V4 (models/deepseek_v4/, their `batch_invariant` flags). Sparse MLA, decode and prefill
  alike, is `invariant_attention.latent_block_attention`: each query over its own rows (models/deepseek_v4/invariant.py
  lays them out: the window in KEY_BLOCK blocks at absolute position offsets, the compressed rows
  in ascending row id), the sink in the one softmax, a chunk's own rows as the cache returns them.
  The lightning indexer's scores are `invariant_attention.index_scores` (per query and block of rows, then a pairwise
  sum over heads), so ties meet the stable-sort rule (score descending, lower row first) with the
  same bits in every batch. The compressors pool with `slot_pool`; the routed experts run each
  expert's rows through `linear` and add a token's k outputs in ascending expert id; the
  hyper-connections' sums over streams are `pairwise_sum`s and their mix has no batched matmul;
  the grouped output projection is one `linear` per group.

`BatchInvariantMode` (a `TorchFunctionMode`) reroutes `F.linear`, `F.silu`, `F.gelu`, `F.softplus`
and `sigmoid` while a wrapped model runs, so model files need no change for those; it refuses
`F.scaled_dot_product_attention`. It costs a Python call per torch call: measured on SmolLM2's
batch-1 decode (about 4000 calls a step), 9.0 ms per token without it and 20.2 ms under it, so the
CPU default path below runs without it. `make_batch_invariant` wraps a model's `forward` (unless
native) and `compute_logits`; the runner calls it, and gives the attention backend and the
sampler their flag, only when the mode is on (off: nothing here runs). DeepSeek-V4 reads the flag
from the backend when it binds its caches.

The CPU default (`resolve_batch_invariant`, `native_path`). With DEEPINFER_BATCH_INVARIANT unset,
the mode is on where it costs (almost) nothing: fp32 on the CPU with the C++ kernels built
(`kernel_isa() > 0`), the torch attention backend, a Llama-family or Gemma 3 model. There every op
of the forward is row-independent as it runs, so no TorchFunctionMode is needed:

- quantized linear layers and LM head: the integer kernels (ops/qdot.py: int8 activations per 32
  values, exact int32 sums, blocks combined in a fixed order); float linear layers (an HF
  checkpoint) get `linear` as their forward (`use_invariant_linears`);
- RMSNorm, RoPE, SwiGLU and the cache store: fused_cpu.cpp's per-row loops; Gemma's GeGLU:
  fused_cpu.cpp's `gelu_tanh_mul` (F.gelu rounds a thread chunk's tail differently: with 3
  threads over Gemma's 2048 columns a row's bits move); residual adds and scales are elementwise;
- attention: invariant_cpu.cpp through `attention/invariant.py` (the KEY_BLOCK rule below, in C++,
  decode and prefill alike);
- the sampler: `row_sum`.

tests/ops/test_invariant_cpu.py checks each op (a row alone vs inside a batch, under 1-3
threads), tests/models/test_cpu_determinism.py the engine on the real SmolLM2 and Gemma 3 GGUFs.
DEEPINFER_BATCH_INVARIANT=0 turns it off (the few-row linear swap and the plain kernels come back);
=1 turns it on anywhere, through BatchInvariantMode off the native path. Other dtypes (a bf16
compute dtype that `--dtype auto` picks for a large float model), DeepSeek-V4, GPUs and the Triton
backend keep it off unless asked for.

Scope: bits are the same across batches and chunkings of one engine (a fixed thread count, dtype
and machine), not across machines or thread counts. Verified on the CPU (fp32, bf16; fp8 and bf16
KV caches) for the Llama family and Gemma 3, and for DeepSeek-V4 (fp32, MXFP8 rows; sliding, CSA
and HCA layers, hash and top-k MoE; tests/models/deepseek_v4/test_v4_batch_invariant.py). Not
covered: V4's MTP draft module runs outside the mode (its drafts may move with the batch; V4 with
speculative decoding is untested here); penalties are exact per row but untested.
"""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from deepinfer.contracts.model import ModelCapabilities
from deepinfer.model_executor.layers.ops import fused

ROW_MULTIPLE = 4  # MKL matmuls (attention's bmm; linear off the CPU) run on a multiple of 4 rows
ONEDNN_MIN_ROWS = 2  # oneDNN's linear takes a GEMV kernel for 1 row: a lone row gets a zero row
ONEDNN_ROW_BUCKET = 16  # rows are padded to a power of two up to this, then to a multiple of it
_ONEDNN = torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_linear_pointwise")
VOCAB_BLOCK = 256  # elements per first-level block of `row_sum`


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`F.linear` whose rows' bits do not depend on the call: x [..., K] -> [..., N]. On the CPU
    (fp32, bf16) oneDNN on at least `ONEDNN_MIN_ROWS` rows, else rows padded to a multiple of
    `ROW_MULTIPLE` (zero rows, dropped after)."""
    rows = x.reshape(-1, x.shape[-1])  # [M, K]
    num_rows = rows.shape[0]
    if _onednn_ok(rows, weight):
        bucket = onednn_rows(num_rows)
        if num_rows < bucket:
            rows = F.pad(rows, (0, 0, 0, bucket - num_rows))  # [M', K]
        out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), weight, bias, "none", [], "")  # [M', N]
    else:
        out = F.linear(pad_dim(rows, 0, ROW_MULTIPLE), weight, bias)  # [M', N]
    if out.shape[0] != num_rows:
        out = out[:num_rows]  # [M, N]
    return out.reshape(*x.shape[:-1], out.shape[-1])  # [..., N]


def onednn_rows(num_rows: int) -> int:
    """The row count a call of `num_rows` rows runs with: at least ONEDNN_MIN_ROWS, a power of two up
    to ONEDNN_ROW_BUCKET, then a multiple of it. oneDNN keeps a compiled primitive per shape (up to
    1024 of them): one per row count would hold ~15 MB more with every few hundred distinct batch
    sizes a server sees; buckets bound the shapes at about 36 per weight for 512-row steps."""
    if num_rows <= ONEDNN_ROW_BUCKET:
        return max(ONEDNN_MIN_ROWS, 1 << (num_rows - 1).bit_length())
    return -(-num_rows // ONEDNN_ROW_BUCKET) * ONEDNN_ROW_BUCKET


def _onednn_ok(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """oneDNN's linear: CPU tensors of one dtype, fp32 or bf16, and a contiguous weight."""
    return (_ONEDNN and rows.device.type == "cpu" and rows.dtype == weight.dtype
            and rows.dtype in (torch.float32, torch.bfloat16) and weight.is_contiguous())


def sigmoid(x: torch.Tensor) -> torch.Tensor:
    """1 / (1 + exp(-x)), elementwise with the same bits at any position."""
    return torch.exp(-x).add_(1.0).reciprocal_()


def silu(x: torch.Tensor, inplace: bool = False) -> torch.Tensor:
    """x / (1 + exp(-x)), written into x when `inplace` (F.silu's signature)."""
    out = x / torch.exp(-x).add_(1.0)
    return x.copy_(out) if inplace else out


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU from `tanh` (approximate="tanh") or `erf`, with IEEE arithmetic around it."""
    if approximate == "tanh":
        inner = (x + 0.044715 * x * x * x) * math.sqrt(2.0 / math.pi)  # [...]
        return 0.5 * x * (1.0 + torch.tanh(inner))
    return 0.5 * x * (1.0 + torch.erf(x * (1.0 / math.sqrt(2.0))))


def softplus(x: torch.Tensor, beta: float = 1.0, threshold: float = 20.0) -> torch.Tensor:
    """log(1 + exp(beta x)) / beta, and x where beta x > threshold (F.softplus's rule), from `exp` and
    `log1p`."""
    scaled = x * beta
    return torch.where(scaled > threshold, x, torch.log1p(torch.exp(scaled)) / beta)


def row_sum(x: torch.Tensor) -> torch.Tensor:
    """Sum over the last dim, [..., V] -> [...]: blocks of `VOCAB_BLOCK` (zero-padded), then their
    sums. No reduction has a single output element, so none is split across threads."""
    pad = -x.shape[-1] % VOCAB_BLOCK
    if pad:
        x = F.pad(x, (0, pad))  # [..., V']
    blocks = x.reshape(*x.shape[:-1], -1, VOCAB_BLOCK).sum(dim=-1)  # [..., V' / 256]
    return blocks.sum(dim=-1)  # [...]


def pairwise_sum(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Sum over `dim` as a pairwise tree over a power-of-two length (zero-padded). Zero entries at
    the end add exact zeros, so the result does not depend on how far a row is padded."""
    dim = dim % x.dim()
    size = x.shape[dim]
    width = 1 << max(0, size - 1).bit_length()
    if width != size:
        pad = [0, 0] * (x.dim() - dim - 1) + [0, width - size]
        x = F.pad(x, pad)
    while x.shape[dim] > 1:
        pairs = x.unflatten(dim, (-1, 2))
        x = pairs.select(dim + 1, 0) + pairs.select(dim + 1, 1)
    return x.squeeze(dim)


def pad_dim(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """x zero-padded at the end of `dim` to a multiple of `multiple`."""
    dim = dim % x.dim()
    pad = -x.shape[dim] % multiple
    return F.pad(x, [0, 0] * (x.dim() - dim - 1) + [0, pad]) if pad else x


def row_matmul(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """a [..., M, K] @ b [..., K, N] (same batch dims), one bmm on rows padded to a multiple of
    `ROW_MULTIPLE`, contiguous operands: a row's bits depend on that row and b alone. -> [..., M, N]."""
    rows = a.shape[-2]
    a = pad_dim(a, -2, ROW_MULTIPLE)
    out = torch.bmm(a.reshape(-1, *a.shape[-2:]).contiguous(), b.reshape(-1, *b.shape[-2:]).contiguous())
    out = out.view(*a.shape[:-1], out.shape[-1])  # [..., M', N]
    return out[..., :rows, :] if out.shape[-2] != rows else out


def slot_pool(kv: torch.Tensor, score: torch.Tensor) -> torch.Tensor:
    """DeepSeek-V4's compressor pooling: a softmax over the slots (dim 1) per channel, kv [r, S, D]
    weighted by it. Elementwise `exp` after an exact max and pairwise sums over the slots, so a
    window's row does not depend on how many windows share the call. score [r, S, D] -> [r, D]."""
    weights = (score - score.amax(dim=1, keepdim=True)).exp_()  # [r, S, D]
    return pairwise_sum(kv * weights, dim=1) / pairwise_sum(weights, dim=1)  # [r, D]


_HANDLERS = {
    F.linear: linear,
    F.silu: silu,
    F.gelu: gelu,
    F.softplus: softplus,
    torch.sigmoid: sigmoid,
    torch.Tensor.sigmoid: sigmoid,
}
_REFUSED = {F.scaled_dot_product_attention: "its CPU kernel's tiles depend on the sequence lengths"}


class BatchInvariantMode(TorchFunctionMode):
    """Reroutes the ops above to their invariant forms while a wrapped model runs."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        handler = _HANDLERS.get(func)
        if handler is not None:
            return handler(*args, **kwargs)
        if func in _REFUSED:
            raise RuntimeError(f"{func.__name__} is not batch-invariant ({_REFUSED[func]}); "
                               "DEEPINFER_BATCH_INVARIANT needs the attention backend's invariant path")
        return func(*args, **kwargs)


def _under_mode(method):
    """`method` run inside BatchInvariantMode."""

    @functools.wraps(method)
    def wrapped(*args, **kwargs):
        with BatchInvariantMode():
            return method(*args, **kwargs)

    return wrapped


def native_path(device: torch.device, dtype: torch.dtype, capabilities: ModelCapabilities) -> bool:
    """Whether a model runs the mode without `BatchInvariantMode` around its forward (the CPU
    default path): fp32 on the CPU with the C++ kernels built (`kernel_isa() > 0`), for a model class
    whose every op is then row-independent as it is (`capabilities.native_batch_invariant`)."""
    return (torch.device(device).type == "cpu" and dtype == torch.float32 and capabilities.native_batch_invariant
            and fused.kernel_isa() > 0)  # the instruction set the fused ops run their kernels with


def resolve_batch_invariant(knob: bool | None, device: torch.device, attention_backend: str,
                            capabilities: ModelCapabilities, dtype: torch.dtype) -> bool:
    """DEEPINFER_BATCH_INVARIANT as the engine runs it: as set (1 / 0), else (unset) on exactly where
    it costs (almost) nothing: the native path (`native_path`) with the torch attention backend
    (`attention_backend` as requested: auto or torch; triton keeps it off). `dtype` is the compute
    dtype the engine resolves without the mode (the mode's fp32 rule then changes nothing)."""
    if knob is not None:
        return knob
    return attention_backend != "triton" and native_path(device, dtype, capabilities)


def make_batch_invariant(model, native: bool = False) -> None:
    """Run the model in the mode from now on: `model.forward` in BatchInvariantMode, or on the native
    path (`native_path`) as it is, with its float linear layers' forward replaced by `linear`;
    `model.compute_logits` in BatchInvariantMode either way (a float LM head or a tied embedding
    reaches `F.linear` there; a few dozen calls per step)."""
    if native:
        use_invariant_linears(model)
    else:
        model.forward = _under_mode(model.forward)
    model.compute_logits = _under_mode(model.compute_logits)


def use_invariant_linears(model: nn.Module) -> int:
    """Give every float `nn.Linear` of `model` (subclasses included) a row-independent forward: plain
    ones (nn.Linear's own forward) `linear` directly, others (a tensor-parallel row split with its
    all-reduce) their own forward in BatchInvariantMode. Quantized layers (integer kernels) are not
    nn.Linear and stay as they are. Returns how many layers changed."""
    layers = [m for m in model.modules() if isinstance(m, nn.Linear)]
    for m in layers:
        m.forward = _linear_of(m) if type(m).forward is nn.Linear.forward else _under_mode(m.forward)
    return len(layers)


def _linear_of(module: nn.Linear):
    def forward(x: torch.Tensor) -> torch.Tensor:
        return linear(x, module.weight, module.bias)  # [..., out]

    return forward
