"""Fused RMSNorm: y = x / sqrt(mean(x^2) + eps) * w, forward and backward in one pass each.

Forward reads x and w once and writes y and one fp32 rstd per row (kept for backward, so backward
never recomputes the reduction). Backward reads dy, x, w, rstd once and writes dx, plus one fp32
partial dw per program: each program walks its share of the rows, so the partials are
(programs x N) instead of (rows x N), and one more launch sums them and rounds dw to the weight's
dtype (torch's sum then cast took two).

With a residual (`fused_add_rms_norm`), forward also reads r and writes s = x + r, the residual
stream, and normalises s: the pre-norm block's `h = x + attn(...)` then `norm2(h)` become one
kernel that reads x and r once, where eager writes h and reads it straight back. Backward adds the
gradient reaching s from the residual path to the norm's own.

Three layers, as Liger-Kernel does: the @triton.jit kernels and their launchers, an
autograd.Function, and `FusedRMSNorm`, a drop-in for nn.RMSNorm (same `weight` parameter, so
state dicts and FSDP2 sharding see the same tensors).
"""
from __future__ import annotations

import torch
import torch.nn as nn

import triton
import triton.language as tl
from perflab_kernels.triton import pdl
from perflab_kernels.triton.device import device_index, pipeline_stages, rows_per_tile, sm_count
from perflab_kernels.triton.launch import Launcher, meta_key
from perflab_kernels.triton.pdl import gdc_prologue  # by name in the kernels: kernels/triton/pdl.py says why
from perflab_kernels.triton.rows import as_shape, by_width, row_major, warps_for


@triton.jit
def _rms_norm_fwd(X, R, S, W, Y, RSTD, stride_x, stride_r, stride_s, stride_y, M, N, eps, HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr,
                  STAGES: tl.constexpr, USE_GDC: tl.constexpr):
    """Tiles of ROWS rows, as one (ROWS, BLOCK) tile (their loads in flight together), tile t on
    program t % programs. With one program a tile (the grid FWD_PROGRAMS_PER_SM = 0 gives) the loop
    runs once; with a few programs per SM each loads w once and, for STAGES > 1, issues the next
    tile's loads while this one is reduced (tl.range num_stages)."""
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    cols = tl.arange(0, BLOCK)
    w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
    for tile in tl.range(tl.program_id(0), tl.cdiv(M, ROWS), tl.num_programs(0), num_stages=STAGES):
        rows = (tile * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # int64 before the stride multiply
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        if HAS_RESIDUAL:  # s = x + r is the residual stream the next block adds to; y normalises it
            x += tl.load(R + rows[:, None] * stride_r + cols[None, :], mask=mask, other=0.0).to(tl.float32)
            x = x.to(S.dtype.element_ty)  # normalise the sum as stored, as the unfused add then norm does
            tl.store(S + rows[:, None] * stride_s + cols[None, :], x, mask=mask)
            x = x.to(tl.float32)
        # fp32 statistics whatever the input dtype: bf16 has 8 mantissa bits, too few for a mean of squares
        rstd = 1.0 / tl.sqrt(tl.sum(x * x, axis=1) / N + eps)
        tl.store(RSTD + rows, rstd, mask=rows < M)
        tl.store(Y + rows[:, None] * stride_y + cols[None, :], (x * rstd[:, None] * w[None, :]).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _rms_norm_bwd(DY, DS, X, W, RSTD, DX, DW_PARTIAL, stride_dy, stride_ds, stride_x, stride_dx, M, N, HAS_DS: tl.constexpr, BLOCK: tl.constexpr, ROWS: tl.constexpr, STAGES: tl.constexpr,
                  USE_GDC: tl.constexpr):
    """Tiles of ROWS rows dealt round-robin, last tile first (the launch settings below say why):
    program p takes tiles T-1-p, T-1-p-P, ... (one (ROWS, BLOCK) tile, loads in flight together)
    and writes one fp32 partial dw. STAGES > 1 asks Triton's software pipeliner to issue the next
    tile's loads while this one is reduced (tl.range num_stages)."""
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    tiles = tl.cdiv(M, ROWS)
    for step in tl.range(pid, tiles, tl.num_programs(0), num_stages=STAGES):
        rows = ((tiles - 1 - step) * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # int64 before the stride multiply
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        x = tl.load(X + rows[:, None] * stride_x + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + rows[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_mask, other=0.0)
        x_hat = x * rstd[:, None]
        wdy = w[None, :] * dy
        # d/dx of x * rstd(x): rstd * (wdy - x_hat * mean(wdy * x_hat))
        dx = rstd[:, None] * (wdy - x_hat * (tl.sum(wdy * x_hat, axis=1) / N)[:, None])
        if HAS_DS:  # the residual sum's own gradient joins the norm's: d(x + r) = ds + dnorm
            dx += tl.load(DS + rows[:, None] * stride_ds + cols[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + rows[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty), mask=mask)
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * N + cols, tl.sum(dw, axis=0), mask=col_mask)


@triton.jit
def _rms_norm_dw(DW_PARTIAL, DW, P, N, BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, USE_GDC: tl.constexpr):
    """dw = sum of the P partial rows, in fp32 in a fixed order (deterministic), rounded once to
    the weight's dtype: one launch where torch's sum(0) then .to(dtype) take two."""
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    for first in range(0, P, BLOCK_P):
        rows = first + tl.arange(0, BLOCK_P)
        acc += tl.load(DW_PARTIAL + rows[:, None] * N + cols[None, :], mask=(rows < P)[:, None] & (cols < N)[None, :], other=0.0)
    tl.store(DW + cols, tl.sum(acc, axis=0).to(DW.dtype.element_ty), mask=cols < N)


# Launch settings (benchmarks/kernel_configs.py sweeps them on a GPU): warps per row program by the
# row's block width, and backward programs per SM. Forward rows up to 4096 wide take 4 warps: more
# elements a thread put more loads in flight each, which brings the forward close to a copy's speed
# (kernel_configs' rms_wide group). With the residual (two tiles loaded a row) 8 warps stay, a little
# faster than 4 both chained and after an L2 flush.
FWD_WARPS = {2048: 4, 8192: 16}
FWD_RESIDUAL_WARPS = {2048: 8, 8192: 16}
# Backward programs per SM, with BWD_STAGES below: a few programs per SM with a pipelined row loop
# beat more programs unpipelined at every shape of benchmarks/kernel_configs.py's rms_stages sweep,
# and the dw partials stay small (programs x N fp32). The rows are dealt round-robin, last first:
# round-robin because a program taking a consecutive share of rows was slower at every width, with
# or without the residual. Last first because a backward that straight follows
# its forward (the kernel bench's fwd+bwd; no step of a model) then reads first the rows whose x the
# forward left in L2; the backward alone is the same either way.
BWD_WARPS = {2048: 4, 4096: 8, 8192: 16}
BWD_PROGRAMS_PER_SM = 2
# Rows per tile: one row a program (forward) or a loop step (backward) keeps 4-8 KB of loads in
# flight per program; benchmarks/kernel_configs.py sweeps 2 and 4 against it.
FWD_ROWS = 1
BWD_ROWS = 1
# Forward programs: 0 launches one program a tile (8192 at 8192 rows, each loading w again); N > 0
# launches N per SM, each looping over its tiles with FWD_STAGES tiles' loads in flight.
FWD_PROGRAMS_PER_SM = 0
FWD_STAGES = 1
# Software-pipelined row loop in backward (tl.range num_stages): the next rows' x and dy loads are
# issued while this row is reduced, so each program keeps ~4 rows (32 KB at 2048 bf16) in flight
# where the loop as written (1) waits on each row's loads.
BWD_STAGES = {2048: 4, 4096: 3}  # by row width, as the warps: at 4096 wide, 4 stages were slower than 3 (rms_stages)
# The dw reduction: up to DW_BLOCK_P partial rows x DW_BLOCK_N columns a step, so a model's partials
# are summed in one step by many narrow programs, each with all its loads in flight at once; that
# beat a few wide ones and torch's sum + cast, at about twice its speed (kernel_configs' rms_dw group).
DW_BLOCK_P, DW_BLOCK_N = 512, 16
# The dw launch as a PDL dependent of the backward launch before it, whatever pdl.ENABLED says: the
# two are always adjacent in the stream, so dw's programs can be placed while backward runs and
# start summing as soon as its partials land (a small gain at 2048 wide, level at 4096; the pdl group
# of benchmarks/kernel_configs.py). Only dw is launched early: with every launch a dependent
# (pdl.ENABLED) the norm was slower, the backward's persistent grid then placed among the forward's
# last programs, likely unevenly.
DW_DEPENDENT = True

# The launches, through kernels/triton/launch.py's cache of compiled kernels (host cost per launch).
_launch_fwd, _launch_bwd, _launch_dw = Launcher(_rms_norm_fwd), Launcher(_rms_norm_bwd), Launcher(_rms_norm_dw)


def _block(n: int) -> int:
    block = triton.next_power_of_2(n)
    if block > 65536:
        raise ValueError(f"fused RMSNorm holds a row in registers; rows of {n} > 65536 elements are not supported")
    return block


# Launch plans: everything a launch needs besides its tensors, worked out once per shape, dtype,
# device and setting. Working it out each call (block, warps, pipeline stages, grid, the launch's
# keyword dict and its share of the cache key) cost about half as much host time as the C launch
# itself. The key holds every module
# setting above by value, the warps tables too (tests and benchmarks/kernel_configs.py replace
# them; by value, not id(), which Dynamo cannot trace on a dict: a graph break in a compiled block).
_plans: dict[tuple, tuple] = {}
MAX_PLANS = 256


def _plan(key: tuple, make) -> tuple:
    if torch.compiler.is_compiling():  # Dynamo traces the plan's arithmetic, not a global cache's mutation
        return make()
    plan = _plans.get(key)
    if plan is None:
        if len(_plans) >= MAX_PLANS:
            _plans.clear()
        plan = _plans[key] = make()
    return plan


def _fwd_plan(M: int, N: int, element_size: int, index: int, residual: bool, gdc: bool) -> tuple:
    """(grid, meta, meta key) of a forward launch."""
    block = _block(N)
    rows = rows_per_tile(FWD_ROWS, index >= 0)
    tiles = triton.cdiv(M, rows)
    programs = min(tiles, sm_count(index) * FWD_PROGRAMS_PER_SM) if FWD_PROGRAMS_PER_SM else tiles
    loads = 2 if residual else 1  # the (ROWS, BLOCK) tiles a pipelined stage buffers
    stages = pipeline_stages(FWD_STAGES, loads * rows * block * element_size, index)
    meta = dict(HAS_RESIDUAL=residual, BLOCK=block, ROWS=rows, STAGES=stages, USE_GDC=gdc, num_warps=warps_for(block, FWD_RESIDUAL_WARPS if residual else FWD_WARPS), **pdl.launch_options(gdc))
    return (programs,), meta, meta_key(meta)


def _bwd_plan(M: int, N: int, element_size: int, index: int, has_ds: bool, gdc: bool, dw_gdc: bool) -> tuple:
    """(programs, backward grid/meta/meta key, dw grid/meta/meta key). `gdc`: both
    launches are PDL dependents (pdl.ENABLED); `dw_gdc`: dw is a dependent of backward, which then
    runs the PDL prologue (its wait a no-op when it was launched plainly) to let dw be placed."""
    programs = min(M, sm_count(index) * BWD_PROGRAMS_PER_SM)
    block = _block(N)
    loads = 3 if has_ds else 2  # x, dy (and ds): what each pipelined stage buffers
    rows = rows_per_tile(BWD_ROWS, index >= 0)
    stages = pipeline_stages(by_width(block, BWD_STAGES, 4), loads * rows * block * element_size, index)
    meta = dict(HAS_DS=has_ds, BLOCK=block, ROWS=rows, STAGES=stages, USE_GDC=gdc or dw_gdc, num_warps=warps_for(block, BWD_WARPS), **pdl.launch_options(gdc))
    dw_meta = dict(BLOCK_P=min(DW_BLOCK_P, triton.next_power_of_2(programs)), BLOCK_N=DW_BLOCK_N, USE_GDC=gdc or dw_gdc, num_warps=4, **pdl.launch_options(gdc or dw_gdc))
    return (programs, (programs,), meta, meta_key(meta), (triton.cdiv(N, DW_BLOCK_N),), dw_meta, meta_key(dw_meta))


def rms_norm_forward(x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """y = rmsnorm(x [+ residual]) * w; returns (y, rstd, the sum or None)."""
    shape = x.shape
    x2, M, N, stride_x = row_major(x)
    y = torch.empty_like(x2)  # contiguous (rows.py): its rows, and s's, are N apart
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    r2, _, _, stride_r = row_major(residual) if residual is not None else (x2, M, N, stride_x)
    s = torch.empty_like(x2) if residual is not None else x2
    index = device_index(x)
    gdc = pdl.use_gdc(x)
    grid, meta, key = _plan((M, N, x2.dtype, index, residual is not None, gdc, FWD_ROWS, FWD_PROGRAMS_PER_SM, FWD_STAGES, tuple(FWD_WARPS.items()), tuple(FWD_RESIDUAL_WARPS.items())),
                            lambda: _fwd_plan(M, N, x2.element_size(), index, residual is not None, gdc))
    _launch_fwd.launch(grid, (x2, r2, s, weight, y, rstd, stride_x, stride_r, N if residual is not None else stride_x, N, M, N, eps), meta, key)
    return as_shape(y, shape), rstd, (as_shape(s, shape) if residual is not None else None)


def rms_norm_backward(dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor, ds: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients of y = rmsnorm(x) * w, plus `ds` (the gradient reaching x from elsewhere, the
    residual stream's) when given; returns (dx, dw)."""
    shape = x.shape
    x2, M, N, stride_x = row_major(x)
    dy2, _, _, stride_dy = row_major(dy)
    ds2, _, _, stride_ds = row_major(ds) if ds is not None else (dy2, M, N, stride_dy)
    dx = torch.empty_like(x2)  # contiguous (rows.py): rows N apart
    index = device_index(x)
    gdc = pdl.use_gdc(x)
    dw_gdc = DW_DEPENDENT and pdl.available(x)
    programs, grid, meta, key, dw_grid, dw_meta, dw_key = _plan(
        (M, N, x2.dtype, index, ds is not None, gdc, dw_gdc, BWD_ROWS, BWD_PROGRAMS_PER_SM, tuple(BWD_STAGES.items()), DW_BLOCK_P, DW_BLOCK_N, tuple(BWD_WARPS.items())),
        lambda: _bwd_plan(M, N, x2.element_size(), index, ds is not None, gdc, dw_gdc))
    dw_partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    _launch_bwd.launch(grid, (dy2, ds2, x2, weight, rstd, dx, dw_partial, stride_dy, stride_ds, stride_x, N, M, N), meta, key)
    dw = torch.empty_like(weight)
    _launch_dw.launch(dw_grid, (dw_partial, dw, programs, N), dw_meta, dw_key)
    return as_shape(dx, shape), dw


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        y, rstd, _ = rms_norm_forward(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        x, weight, rstd = ctx.saved_tensors
        dx, dw = rms_norm_backward(dy, x, weight, rstd)
        return dx, dw, None


class AddRMSNormFunction(torch.autograd.Function):
    """(s, y) = (x + r, rmsnorm(x + r) * w) in one pass: the pre-norm block's residual add and the
    next norm read x and r once and write s and y, where eager reads s back for the norm."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float):
        y, rstd, s = rms_norm_forward(x, weight, eps, residual)
        ctx.save_for_backward(s, weight, rstd)
        return s, y

    @staticmethod
    def backward(ctx, ds: torch.Tensor | None, dy: torch.Tensor | None):
        s, weight, rstd = ctx.saved_tensors
        if dy is None:  # only the sum was used
            return ds, ds, None, None
        dx, dw = rms_norm_backward(dy, s, weight, rstd, ds)
        return dx, dx, dw, None


def fused_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return RMSNormFunction.apply(x, weight, eps)


def fused_add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> tuple[torch.Tensor, torch.Tensor]:
    """(x + residual, rmsnorm(x + residual) * weight)."""
    return AddRMSNormFunction.apply(x, residual, weight, eps)


class FusedRMSNorm(nn.Module):
    """Drop-in for nn.RMSNorm(dim, eps) with the fused Triton kernels."""

    def __init__(self, dim: int, eps: float = 1e-6, device=None, dtype=None):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    @classmethod
    def from_module(cls, norm: nn.RMSNorm) -> FusedRMSNorm:
        fused = cls.__new__(cls)
        nn.Module.__init__(fused)
        fused.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        fused.weight = norm.weight  # the same Parameter: swapping keeps state dicts and sharding intact
        return fused

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fused_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(x + residual, self(x + residual)) in one kernel: see src/models/mini_llm.py add_norm."""
        return fused_add_rms_norm(x, residual, self.weight, self.eps)
