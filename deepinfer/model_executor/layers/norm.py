"""RMSNorm, computed in fp32 and cast back."""

import torch
import torch.nn.functional as F
from torch import nn

from deepinfer.model_executor.layers.ops import fused


def torch_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float = 0.0) -> torch.Tensor:
    """x [..., E] -> x / rms(x) * (offset + weight) [..., E], in fp32, cast back to x's dtype."""
    w = weight.float() + offset if offset else weight.float()
    return F.rms_norm(x.float(), (x.shape[-1],), w, eps).to(x.dtype)


rms_norm = fused.rms_norm_op(torch_rms_norm)  # the C++ kernel where it serves the call, else torch_rms_norm


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w). Gemma stores w with offset 1; Llama-family with offset 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps, self.offset)  # [..., E]
