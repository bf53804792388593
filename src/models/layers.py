"""Layers more than one architecture uses, as plain nn.Modules: SwiGLU's activation and MLP, the
fused-kernel hooks (split_projection, add_norm) that kernels/triton's modules plug into."""
from __future__ import annotations

import math

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


class PreNormBlock(nn.Module):
    """A pre-norm transformer block: x + attn(norm1(x)), then + ffn(norm2(.)), the residual add joined
    with the second norm (add_norm). Subclasses make norm1, attn, norm2 and ffn; what follows x
    (LLaMA's rotary table) goes to attn."""

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        h, normed = add_norm(self.norm2, x, self.attn(self.norm1(x), *attn_args))
        return h + self.ffn(normed)


def gpt2_init(name: str, init_std: float, n_layers: int) -> tuple[str, float]:
    """GPT-2's initialisation of parameter `name`: ("zeros" | "ones" | "normal", std). N(0, init_std)
    for weights, the two projections that write into the residual stream scaled by 1/sqrt(2 * n_layers)
    so its variance stays put with depth; norms ones, biases zeros."""
    if name.endswith("bias"):
        return "zeros", 0.0
    if ".norm" in name or name.startswith("norm."):
        return "ones", 0.0
    if name.endswith(("out_proj.weight", "ffn.down.weight")):
        return "normal", init_std / math.sqrt(2 * n_layers)
    return "normal", init_std


def logits_or_loss(head: nn.Module, x: torch.Tensor, targets: torch.Tensor | None) -> torch.Tensor:
    """head(x), the logits (B, T, vocab); or, given targets and a head with a fused `loss` (the fused
    linear + cross-entropy of kernels/triton), the mean loss without ever forming the logits. Called
    inside the model's forward, so FSDP2's root hooks cover the head weight it reads."""
    if targets is not None:
        fused_loss = getattr(head, "loss", None)
        if fused_loss is None:
            raise ValueError("model(idx, targets) needs the fused linear + cross-entropy head (kernels.fused: linear_cross_entropy)")
        return fused_loss(x, targets)
    return head(x)  # (B, T, vocab)
