"""Large linear layers on a few rows on the CPU: verification steps and small batches.

`F.linear` on a handful of rows (a verification step of k + 1 rows, a decode batch of 2..16) can
cost several times one row's for a large weight. Measured on an AMD EPYC (AVX-512, torch 2.13
CPU): a [129280, 4096] fp32 head takes 102 ms for 1 row, 219 ms for 2 and 425 ms for 6 through
F.linear, and 108 ms and 206 ms for 2 and 6 rows written as W @ x.T. Which form wins depends on
the CPU and its BLAS, so `use_few_row_linear` times both once on the model's largest weight and
switches its large `nn.Linear` layers (>= LARGE_WEIGHT elements, where the product is bound by
reading the weight) to `FewRowLinear` only when W @ x.T is clearly faster there. Results differ
from F.linear's only by float rounding (the sum order of each dot product).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.layers.ops.qmatmul import best_time

MAX_FEW_ROWS = 16  # above this F.linear's blocked GEMM is efficient again
LARGE_WEIGHT = 1 << 22  # elements: smaller weights stay on F.linear
_PROBE_ROWS = 4
_WIN = 0.8  # switch only when W @ x.T takes under 80% of F.linear's time


class FewRowLinear(nn.Linear):
    """nn.Linear whose 2 .. MAX_FEW_ROWS-row inputs run as W @ x.T (same parameters, same names)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        if not 1 < rows <= MAX_FEW_ROWS:
            return F.linear(x, self.weight, self.bias)
        out = torch.mm(self.weight, x.reshape(rows, x.shape[-1]).to(self.weight.dtype).t()).t()  # [rows, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)  # [..., out]


def use_few_row_linear(model: nn.Module) -> int:
    """On a CPU model, switch its large plain nn.Linear layers to FewRowLinear if a probe on the
    largest weight shows W @ x.T faster for a few rows; returns how many layers switched."""
    layers = [m for m in model.modules() if type(m) is nn.Linear and m.weight.numel() >= LARGE_WEIGHT]
    if not layers or layers[0].weight.device.type != "cpu":
        return 0
    if not _few_rows_faster(max(layers, key=lambda m: m.weight.numel()).weight):
        return 0
    for m in layers:
        m.__class__ = FewRowLinear
    return len(layers)


@torch.inference_mode()
def _few_rows_faster(weight: torch.Tensor) -> bool:
    x = torch.randn(_PROBE_ROWS, weight.shape[1], dtype=weight.dtype)  # [4, in]
    linear = best_time(lambda: F.linear(x, weight))
    transposed = best_time(lambda: torch.mm(weight, x.t()))
    return transposed < _WIN * linear
