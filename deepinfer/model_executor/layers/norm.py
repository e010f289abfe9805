"""RMSNorm, computed in fp32 and cast back."""

import torch
from torch import nn


class RMSNorm(nn.Module):
    """y = x / rms(x) * (offset + w). Gemma stores w with offset 1; Llama-family with offset 0."""

    def __init__(self, hidden_size: int, eps: float = 1e-6, offset: float = 0.0):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size) if offset == 0.0 else torch.zeros(hidden_size))
        self.eps = eps
        self.offset = offset

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        w = self.weight.float() + self.offset if self.offset else self.weight.float()
        return (x32 * w).to(dtype)
