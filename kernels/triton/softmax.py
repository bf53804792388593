"""Fused softmax over the last dimension, forward and backward in one pass each.

Forward reads each row once and writes it once: the whole row sits in registers (max, exp, sum,
divide), where eager softmax on a wide row may read it up to three times. Backward reads y and dy
once and writes dx = y * (dy - sum(y * dy)), saving y (not x) from forward as eager does.

One program per row, the row in one block: up to 65536 columns (256 KB of fp32 registers per
program is the most a 64K-register SM gives one block); attention scores and classifier outputs
fit. Wider rows are refused with the limit named.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import triton
import triton.language as tl
from perflab_kernels.triton import pdl
from perflab_kernels.triton.device import device_index, pipeline_stages, sm_count
from perflab_kernels.triton.launch import Launcher
from perflab_kernels.triton.pdl import gdc_prologue  # by name in the kernels: kernels/triton/pdl.py says why
from perflab_kernels.triton.rows import as_rows, as_shape

MAX_COLS = 65536
# Programs: 0 launches one a row; N > 0 launches N per SM, each looping over rows with STAGES
# rows' loads in flight (tl.range num_stages). benchmarks/kernel_configs.py's softmax group sweeps them.
PROGRAMS_PER_SM = 0
STAGES = 1


@triton.jit
def _softmax_fwd(X, Y, stride_x, stride_y, M, N, BLOCK: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    for r in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        row = tl.cast(r, tl.int64)  # before the stride multiply: rows x stride may pass 2**31
        x = tl.load(X + row * stride_x + cols, mask=mask, other=-float("inf")).to(tl.float32)
        e = tl.exp(x - tl.max(x, axis=0))
        tl.store(Y + row * stride_y + cols, (e * (1.0 / tl.sum(e, axis=0))).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _softmax_bwd(DY, Y, DX, stride_dy, stride_y, stride_dx, M, N, BLOCK: tl.constexpr, STAGES: tl.constexpr, USE_GDC: tl.constexpr):
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    for r in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        row = tl.cast(r, tl.int64)  # before the stride multiply: rows x stride may pass 2**31
        y = tl.load(Y + row * stride_y + cols, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0).to(tl.float32)
        dx = y * (dy - tl.sum(y * dy, axis=0))
        tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=mask)


_launch_fwd, _launch_bwd = Launcher(_softmax_fwd), Launcher(_softmax_bwd)  # kernels/triton/launch.py: cached launches


def _launch(n: int) -> tuple[int, int]:
    if n > MAX_COLS:
        raise ValueError(f"fused softmax holds a row in registers; rows of {n} > {MAX_COLS} elements are not supported")
    block = triton.next_power_of_2(n)
    return block, 16 if block >= 16384 else 8 if block >= 2048 else 4


def _grid_and_stages(t: torch.Tensor, block: int, loads: int) -> tuple[int, int]:
    """(programs, pipeline stages) for t's rows: one program a row unless PROGRAMS_PER_SM is set,
    and the stages that `loads` row blocks of t a stage leave room for."""
    rows = t.shape[0]
    if not PROGRAMS_PER_SM and STAGES <= 1:  # the default: no device query on the launch path
        return rows, 1
    index = device_index(t)
    programs = min(rows, sm_count(index) * PROGRAMS_PER_SM) if PROGRAMS_PER_SM else rows
    return programs, pipeline_stages(STAGES, loads * block * t.element_size(), index)


def softmax_forward(x: torch.Tensor) -> torch.Tensor:
    x2 = as_rows(x)
    y = torch.empty_like(x2)
    block, warps = _launch(x2.shape[1])
    gdc = pdl.use_gdc(x2)
    programs, stages = _grid_and_stages(x2, block, 1)
    _launch_fwd((programs,), x2, y, x2.stride(0), y.stride(0), x2.shape[0], x2.shape[1], BLOCK=block, STAGES=stages,
                USE_GDC=gdc, num_warps=warps, **pdl.launch_options(gdc))
    return as_shape(y, x.shape)


def softmax_backward(dy: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    dy2, y2 = as_rows(dy), as_rows(y)
    dx = torch.empty_like(y2)
    block, warps = _launch(y2.shape[1])
    gdc = pdl.use_gdc(y2)
    programs, stages = _grid_and_stages(y2, block, 2)
    _launch_bwd((programs,), dy2, y2, dx, dy2.stride(0), y2.stride(0), dx.stride(0), y2.shape[0], y2.shape[1], BLOCK=block, STAGES=stages,
                USE_GDC=gdc, num_warps=warps, **pdl.launch_options(gdc))
    return as_shape(dx, y.shape)


class SoftmaxFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor) -> torch.Tensor:
        y = softmax_forward(x)
        ctx.save_for_backward(y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y,) = ctx.saved_tensors
        return softmax_backward(dy, y)


def fused_softmax(x: torch.Tensor) -> torch.Tensor:
    """softmax(x, dim=-1)."""
    return SoftmaxFunction.apply(x)


class FusedSoftmax(nn.Module):
    """Drop-in for nn.Softmax(dim=-1)."""

    dim = -1

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_softmax(x)
