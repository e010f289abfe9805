"""Which integer dot-product variant runs the few-row calls (decode, short verifications): measured,
not assumed.

Every variant of `qdot_cpu.cpp` gives the same bits, so which one runs is a question of speed alone,
and at one to eight activation rows the answer depends on the CPU: the fused few-row path is bound
by its shuffles and float steps, not by the integer products, and a 512-bit shuffle costs twice a
256-bit one on a CPU that splits 512-bit instructions in two (AMD Zen 4) but not on one with 512-bit
units (Intel Ice Lake and later). So once per process, where the CPU runs more than one SIMD variant
under DEEPINFER_CPU_ISA's cap, each is timed on one-row products over a Q4_K weight that stays in
the L2 cache (CALIBRATION_BYTES): the instructions per byte, which decide how close to the memory
wall a variant can stream a model's weights, without the memory's noise. The variants are timed in
turns, best of ROUNDS (a few milliseconds in all), and one other than the widest is taken only when
it is at least MARGIN faster. Many-row calls (prefill, batches) keep the widest variant.
DEEPINFER_QDOT_FEW_ROW_ISA names a variant instead (e.g. `avx2`), for measurements.
"""

from __future__ import annotations

import functools
import logging
import os
import time

import torch

from deepinfer.model_executor.layers.ops.cpu_kernels import qdot_levels

logger = logging.getLogger("deepinfer.kernels")

FEW_ROWS = 8  # activation rows (both levels counted) of the fused path (qdot_cpu.cpp's kFusedRows)
CALIBRATION_BYTES = 224 * 2304  # 224 rows of 4096 Q4_K values: 504 KiB
ROUNDS, CALLS = 7, 16  # timed turns per variant, calls per turn
MARGIN = 1.15
_Q4_K, _K, _BLOCK_BYTES = 12, 4096, 144  # ggml type id, row length, bytes per 256 values
_NAMES = {2: "avx2", 3: "avx_vnni", 4: "avx512_vnni"}


def _one_row_gbps(level: int, w: torch.Tensor, x: torch.Tensor) -> float:
    """Weight GB/s of CALLS one-row products of w on `level` (one turn)."""
    run = torch.ops.deepinfer_cpu.qlinear.default
    start = time.perf_counter()
    for _ in range(CALLS):
        run(x, w, _Q4_K, _K, level, 1)
    return CALLS * w.numel() / (time.perf_counter() - start) / 1e9


def _calibration_weight() -> torch.Tensor:
    """A Q4_K matrix of random codes with unit scales, CALIBRATION_BYTES."""
    row_bytes = _K // 256 * _BLOCK_BYTES
    rows = CALIBRATION_BYTES // row_bytes
    w = torch.randint(0, 256, (rows, _K // 256, _BLOCK_BYTES), dtype=torch.uint8,
                      generator=torch.Generator().manual_seed(0))
    w[..., 0:4] = torch.tensor([0, 0x3C, 0, 0x3C], dtype=torch.uint8)  # d = dmin = 1.0 (fp16)
    return w.reshape(rows, row_bytes)


@functools.cache
def few_row_level(default: int) -> int:
    """The variant for calls of at most FEW_ROWS activation rows, given the process's `default` (the
    widest under the cap); see the module docstring."""
    named = os.environ.get("DEEPINFER_QDOT_FEW_ROW_ISA", "").strip().lower()
    if named:
        levels = {v: k for k, v in _NAMES.items()}
        if named not in levels or levels[named] not in qdot_levels():
            raise ValueError(f"DEEPINFER_QDOT_FEW_ROW_ISA must name a variant this CPU runs "
                             f"({', '.join(_NAMES[v] for v in qdot_levels() if v in _NAMES)}); got {named!r}")
        return levels[named]
    candidates = [level for level in qdot_levels() if 2 <= level <= default]
    if len(candidates) < 2:
        return default
    w, x = _calibration_weight(), torch.randn(1, _K, generator=torch.Generator().manual_seed(1))
    speeds = dict.fromkeys(candidates, 0.0)
    for _ in range(ROUNDS):  # in turns: a neighbour's burst slows one turn, not one variant
        for level in candidates:
            speeds[level] = max(speeds[level], _one_row_gbps(level, w, x))
    best = max(speeds, key=speeds.get)
    choice = best if speeds[best] >= MARGIN * speeds[default] else default
    logger.info("few-row integer dot products: %s (one row of a Q4_K weight in cache: %s)", _NAMES[choice],
                ", ".join(f"{_NAMES[v]} {s:.1f} GB/s" for v, s in speeds.items()))
    return choice
