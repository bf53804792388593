"""Fused SwiGLU activation: y = silu(g) * u, forward and backward in one elementwise pass each.

Eager runs silu(g) (read g, write a) and a * u (read a and u, write y): five tensor passes where
three are needed; its backward adds another four or so. Here forward reads g and u once and
writes y; backward reads dy, g, u once and writes dg and du, recomputing sigmoid(g) instead of
saving silu(g) (a tensor the size of the MLP's hidden activations saved for nothing).

The kernel walks the flattened tensors in blocks of 4096 elements (16 KB of bf16 per operand per
program): large enough that each program keeps several 16-byte loads in flight per thread,
small enough that an 8192x8192 input still launches 16K programs to fill 132 SMs.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import triton
import triton.language as tl
from perflab_kernels.triton.launch import Launcher

BLOCK = 4096


@triton.jit
def _swiglu_fwd(G, U, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    y = g * tl.sigmoid(g) * u
    tl.store(Y + offs, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd(DY, G, U, DG, DU, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    # d silu(g)/dg = sig * (1 + g * (1 - sig))
    tl.store(DG + offs, (dy * u * sig * (1.0 + g * (1.0 - sig))).to(DG.dtype.element_ty), mask=mask)
    tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)


_launch_fwd, _launch_bwd = Launcher(_swiglu_fwd), Launcher(_swiglu_bwd)  # kernels/triton/launch.py: cached launches


def _flat(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_contiguous() else t.contiguous()


def swiglu_forward(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    if g.shape != u.shape:
        raise ValueError(f"silu(g) * u needs g and u of one shape, got {tuple(g.shape)} and {tuple(u.shape)}")
    g, u = _flat(g), _flat(u)
    y = torch.empty_like(g)
    n = g.numel()
    _launch_fwd((triton.cdiv(n, BLOCK),), g, u, y, n, BLOCK=BLOCK, num_warps=8)
    return y


def swiglu_backward(dy: torch.Tensor, g: torch.Tensor, u: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    dy = _flat(dy)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    n = g.numel()
    _launch_bwd((triton.cdiv(n, BLOCK),), dy, g, u, dg, du, n, BLOCK=BLOCK, num_warps=8)
    return dg, du


class SwiGLUFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        g, u = _flat(g), _flat(u)
        ctx.save_for_backward(g, u)
        return swiglu_forward(g, u)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        g, u = ctx.saved_tensors
        return swiglu_backward(dy, g, u)


def fused_swiglu(g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """silu(g) * u."""
    return SwiGLUFunction.apply(g, u)


class FusedSiLUMul(nn.Module):
    """Drop-in for src/models/mini_llm.py SiLUMul (no parameters)."""

    def forward(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return fused_swiglu(g, u)
