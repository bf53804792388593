"""Layers more than one architecture uses, as plain nn.Modules: SwiGLU's activation and MLP, the
fused-kernel hooks (split_projection, add_norm) that kernels/triton's modules plug into."""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F


def split_projection(linear: nn.Module, x: torch.Tensor, pieces: int) -> tuple[torch.Tensor, ...]:
    """linear(x).chunk(pieces, -1). A linear with `split_forward` (kernels/triton/fp8_linear.py)
    returns the chunks itself and takes their gradients apart in backward, where autograd would
    first copy them into one tensor (in_proj's 8192 x 6144 gradient a block at the seed's shapes)."""
    split = getattr(linear, "split_forward", None)
    return split(x, pieces) if split is not None else linear(x).chunk(pieces, -1)


class SiLUMul(nn.Module):
    """silu(g) * u: SwiGLU's activation as a module of its own, so a fused kernel can replace it."""

    def forward(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return F.silu(g) * u


class SwiGLUFeedForward(nn.Module):
    """LLaMA's MLP: down(silu(gate(x)) * up(x)), no biases."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=False)
        self.up = nn.Linear(dim, hidden, bias=False)
        self.act = SiLUMul()
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.gate(x), self.up(x)))


def add_norm(norm: nn.Module, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, norm(x + residual)); a norm with `add_forward` (kernels/triton/rms_norm.py)
    does both in one kernel instead of writing the sum and reading it straight back."""
    fused = getattr(norm, "add_forward", None)
    if fused is not None:
        return fused(x, residual)
    h = x + residual
    return h, norm(h)
