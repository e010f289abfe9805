"""DeepSeek-V4 streaming window pooling, the core of the KV compressors and the lightning indexer:
HCA (one series) and CSA (two overlapping series).

Every token j contributes a kv vector and a gate score (score + ``position_bias[j mod m]``).
After t tokens, ``floor(t / m)`` compressed rows exist; row w is emitted when token
``w·m + m − 1`` arrives and carries RoPE position ``w·m`` (the compressor's own RoPE base).

HCA row w pools one series over the tokens of window w (m' slots). CSA kv/score are 2·D wide:
half A (channels ``[:D]``) and half B (channels ``[D:]``). CSA row w pools 2m slots, half A of
window w−1 and half B of window w, with a softmax over the slots per channel::

    tokens     0  1  2  3 | 4  5  6  7 | 8  9 10 11 |      (m = 4)
    window         0      |     1      |     2      |
    row 0      -inf (A)     B  B  B  B                      slots before position 0: -inf
    row 1      A  A  A  A   B  B  B  B   (A of window 0, B of window 1)
    row 2                   A  A  A  A   B  B  B  B

    slot layout of one CSA row:  [ A_{w-1}[0..m) | B_w[0..m) ]   -> softmax over 2m slots

Then RMSNorm, then interleaved RoPE on the trailing ``rope_dim`` channels.

``compress_chunk`` works on one request's chunk and carries a :class:`CompressorState` across
chunk boundaries, so any chunking (whole sequence, irregular chunks, token by token) gives
the same rows within float tolerance.

The compressors (`compressor`) and the indexer (`indexer`) are `WindowCompressor`s of their own
widths; this module imports neither.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from deepinfer.contracts.hf_config import HFConfigFields
from deepinfer.contracts.weight_storage import FP32
from deepinfer.model_executor.layers.batch_invariant import slot_pool
from deepinfer.model_executor.layers.norm import RMSNorm
from deepinfer.model_executor.layers.rotary import rope_inv_freq

CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"


@dataclass
class CompressorState:
    """What a compressor carries between chunks of one request (all fp32, fixed shapes).

    kv, score:        [m, C]  the open window; slots ``[0, num_tokens mod m)`` are valid
                      (score already includes ``position_bias``); C = 2·D for CSA, D for HCA.
    prev_a_kv/score:  [m, D]  CSA only ([0, D] for HCA): half A of the last complete window;
                      score is -inf before the first window closes.
    num_tokens:       tokens consumed so far; ``num_rows = num_tokens // m``.
    """

    kv: torch.Tensor
    score: torch.Tensor
    prev_a_kv: torch.Tensor
    prev_a_score: torch.Tensor
    num_tokens: int = 0

    @property
    def ratio(self) -> int:
        return self.kv.shape[0]

    @property
    def num_rows(self) -> int:
        return self.num_tokens // self.ratio

    @property
    def num_pending(self) -> int:
        return self.num_tokens % self.ratio


def compress_rope_inv_freq(config, rope_dim: int) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim/2], attention_scaling) of the ``compress`` RoPE (base compress_rope_theta)."""
    params = (HFConfigFields.of(config).rope_parameters or {}).get("compress") or {}
    return rope_inv_freq(config, rope_dim, params or {"rope_type": "default"}, "compress",
                         default_theta=config.compress_rope_theta)


def apply_interleaved_rope(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor,
                           scaling: float = 1.0) -> torch.Tensor:
    """RoPE on the trailing ``2·len(inv_freq)`` channels of x [n, ..., D], pairs (2i, 2i+1), fp32."""
    half = inv_freq.shape[0]
    rope_dim = 2 * half
    freqs = positions.float()[:, None] * inv_freq.to(x.device)  # [n, rope_dim/2]
    cos, sin = freqs.cos() * scaling, freqs.sin() * scaling  # [n, rope_dim/2]
    extra = (1,) * (x.dim() - 2)
    cos, sin = cos.view(cos.shape[0], *extra, half), sin.view(sin.shape[0], *extra, half)
    nope, rope = x[..., :-rope_dim], x[..., -rope_dim:].float()
    even, odd = rope[..., 0::2], rope[..., 1::2]  # [n, ..., rope_dim/2]
    rotated = torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1)  # [n, ..., rope_dim/2, 2]
    return torch.cat([nope.float(), rotated.flatten(-2)], dim=-1)  # [n, ..., D]


class WindowCompressor(nn.Module):
    """Softmax-gated window pooling with HF parameter names (kv_proj, gate_proj, position_bias, kv_norm).

    ``overlap=True`` is the CSA form (2m slots from two series), ``False`` the HCA form.
    ``batch_invariant`` (DEEPINFER_BATCH_INVARIANT) pools with `batch_invariant.slot_pool`: a row's
    bits then do not depend on how many windows, of how many requests, share the call.
    """

    batch_invariant = False
    param_storage = {"position_bias": FP32}

    def __init__(self, config, head_dim: int, ratio: int, overlap: bool):
        super().__init__()
        self.head_dim, self.compress_rate, self.overlap = head_dim, ratio, overlap
        width = (2 if overlap else 1) * head_dim
        self.kv_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.gate_proj = nn.Linear(config.hidden_size, width, bias=False)
        self.position_bias = nn.Parameter(torch.zeros(ratio, width, dtype=torch.float32))
        self.kv_norm = RMSNorm(head_dim, eps=config.rms_norm_eps)
        rope_dim = config.qk_rope_head_dim  # same RoPE width for the compressor and the indexer
        inv_freq, self.rope_scaling = compress_rope_inv_freq(config, rope_dim)
        self.inv_freq = inv_freq  # [rope_dim/2] fp32; a plain tensor, so casting the model to bf16 keeps it exact

    def init_state(self, device=None) -> CompressorState:
        """The state of a request with no tokens yet."""
        m, d = self.compress_rate, self.head_dim
        width = (2 if self.overlap else 1) * d
        prev_rows = m if self.overlap else 0
        z = torch.zeros(m, width, dtype=torch.float32, device=device)  # [m, C]
        prev_kv = torch.zeros(prev_rows, d, dtype=torch.float32, device=device)  # [m, D]
        prev_score = torch.full((prev_rows, d), float("-inf"), device=device)  # [m, D]
        return CompressorState(z, z.clone(), prev_kv, prev_score, 0)

    def project(self, hidden: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Every token's kv and biased gate score, fp32: hidden [n, H] -> ([n, C], [n, C]).
        Done once for all tokens of a step; the pooling below then runs per request."""
        kv = self.kv_proj(hidden).float()  # [n, C]
        score = self.gate_proj(hidden).float() + self.position_bias.float()[positions % self.compress_rate]  # [n, C]
        return kv, score

    def compress_chunk(self, hidden: torch.Tensor, start_pos: int, state: CompressorState):
        """Consume one request's chunk ``hidden [n, H]`` at positions ``start_pos .. start_pos+n-1``.

        Returns ``(new_rows [r, D] fp32, row_ids [r], new_state)``: the rows whose windows the
        chunk completes. ``state`` is not modified.
        """
        positions = torch.arange(start_pos, start_pos + hidden.shape[0], device=hidden.device)  # [n]
        return self.compress_projected(*self.project(hidden, positions), start_pos, state)

    def compress_projected(self, kv: torch.Tensor, score: torch.Tensor, start_pos: int, state: CompressorState):
        """`compress_chunk` for a chunk already projected: kv, score [n, C] from `project`."""
        if start_pos != state.num_tokens:
            raise ValueError(f"start_pos={start_pos} but the state has consumed {state.num_tokens} tokens")
        m, n = self.compress_rate, kv.shape[0]
        q = state.num_pending
        all_kv = torch.cat([state.kv[:q], kv])  # [q + n, C]
        all_score = torch.cat([state.score[:q], score])  # [q + n, C]
        r = (q + n) // m
        win_kv = all_kv[: r * m].view(r, m, all_kv.shape[1])  # [r, m, C]
        win_score = all_score[: r * m].view(r, m, all_kv.shape[1])  # [r, m, C]
        pooled = self._pool(win_kv, win_score, state)  # [r, D]
        row_ids = torch.arange(state.num_rows, state.num_rows + r, device=kv.device)  # [r]
        rows = self._norm_rope(pooled, row_ids * m)  # [r, D]
        new_state = self._next_state(all_kv[r * m:], all_score[r * m:], win_kv, win_score, state, n)
        return rows, row_ids, new_state

    def _pool(self, win_kv: torch.Tensor, win_score: torch.Tensor, state: CompressorState) -> torch.Tensor:
        """Softmax over the slots of each window, per channel: [r, m, C] -> [r, D]."""
        if win_kv.shape[0] == 0:
            return win_kv.new_zeros(0, self.head_dim)  # [0, D]
        if not self.overlap:
            return self.pool_windows(win_kv, win_score)  # [r, D]
        d = self.head_dim
        a_kv = torch.cat([state.prev_a_kv[None], win_kv[:-1, :, :d]])  # [r, m, D] A of window w-1
        a_score = torch.cat([state.prev_a_score[None], win_score[:-1, :, :d]])  # [r, m, D]
        return self.pool_windows(win_kv, win_score, a_kv, a_score)  # [r, D]

    def pool_windows(self, win_kv: torch.Tensor, win_score: torch.Tensor, a_kv: torch.Tensor | None = None,
                     a_score: torch.Tensor | None = None) -> torch.Tensor:
        """Pool complete windows [r, m, C]; CSA also takes each one's half A of the window before,
        a_kv / a_score [r, m, D]. -> [r, D]"""
        if not self.overlap:
            slots_kv, slots_score = win_kv, win_score  # [r, m, D]
        else:
            d = self.head_dim
            slots_kv = torch.cat([a_kv, win_kv[:, :, d:]], dim=1)  # [r, 2m, D]
            slots_score = torch.cat([a_score, win_score[:, :, d:]], dim=1)  # [r, 2m, D]
        if self.batch_invariant:
            return slot_pool(slots_kv, slots_score)  # [r, D]
        return (slots_kv * slots_score.softmax(dim=1)).sum(dim=1)  # [r, D]

    def rows_at(self, pooled: torch.Tensor, row_ids: torch.Tensor) -> torch.Tensor:
        """Pooled windows [r, D] -> compressed rows [r, D] (RMSNorm, RoPE at row_id * m)."""
        return self._norm_rope(pooled, row_ids * self.compress_rate)  # [r, D]

    def _norm_rope(self, pooled: torch.Tensor, rope_positions: torch.Tensor) -> torch.Tensor:
        normed = self.kv_norm(pooled)  # [r, D]
        return apply_interleaved_rope(normed, rope_positions, self.inv_freq, self.rope_scaling)  # [r, D]

    def _next_state(self, rest_kv, rest_score, win_kv, win_score, state: CompressorState, n: int):
        """Open window = the unpooled tail; for CSA, half A of the last complete window."""
        kv, score = torch.zeros_like(state.kv), torch.zeros_like(state.score)  # [m, C]
        kv[: rest_kv.shape[0]] = rest_kv
        score[: rest_score.shape[0]] = rest_score
        prev_kv, prev_score = state.prev_a_kv, state.prev_a_score  # [m, D]
        if self.overlap and win_kv.shape[0] > 0:
            prev_kv = win_kv[-1, :, : self.head_dim].clone()  # [m, D]
            prev_score = win_score[-1, :, : self.head_dim].clone()  # [m, D]
        return CompressorState(kv, score, prev_kv, prev_score, state.num_tokens + n)
