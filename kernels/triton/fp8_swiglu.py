"""LLaMA's SwiGLU MLP, down(silu(gate(x)) * up(x)), as one autograd function whose five GEMMs run in
float8 (kernels/triton/fp8_linear.py's rowwise_with_gw_tensorwise recipe), with the activation and its
gradient inside the casts.

Three Float8RowwiseLinear and the activation between them move more bytes than the MLP needs. Per
block at M tokens, width K and hidden width H (LLaMA 3.2 1B at 4 x 2048 tokens: M 8192, K 2048,
H 8192, bf16), what this function does instead:

- gate and up read one X: it is cast once, rowwise and transposed, not once for each (84 MB), and
  their weights are cast into one (2H, K) e4m3 operand, so one GEMM writes [G | U] (M, 2H).
- silu(G) * U is computed inside the down projection's rowwise cast of its input (fp8_linear's
  ACT "swiglu"): the activation's output (M x H, 134 MB) is never written nor read back; 268 MB.
- backward: dH = dY W_down is read beside G and U by one cast (`swiglu_grad_e4m3`) that writes
  [dG | dU] in e4m3 with a scale a row: dG and dU (268 MB) are never written nor read back, and
  gate's and up's input gradients come out of one GEMM over 2H instead of two GEMMs and their sum
  (100 MB). About 0.6 GB.

About 1 GB of traffic a block at LLaMA 3.2 1B's shape: a few percent of its step's time.

Every value is rounded where the unfused modules round it (silu(G) to the activation's dtype, then
the product; dG as SiLU's backward of the rounded dH * U, dU as dH * silu(G)), so the float8 operands
are those of the three linears, to one e4m3 step where an input to a cast was computed in another
order; the weights' transposed cast is read from their rowwise cast (fp8_linear's TRANSPOSE_FROM
"e4m3"), which the GEMM's operand needs kept for backward: 2H x K bytes a block.
"""
from __future__ import annotations

import torch
import torch.nn as nn

import triton
import triton.language as tl
from perflab_kernels.triton.device import rows_per_tile
from perflab_kernels.triton.fp8_linear import (
    E4M3,
    MAX_BLOCK,
    ROWWISE_WARPS,
    Float8RowwiseLinear,
    _act,
    _as_stored,
    _silu_grad,
    e4m3_rne,
    pow2_scale,
    rowwise_e4m3,
    transposed_e4m3,
    transposed_from_rowwise,
)
from perflab_kernels.triton.launch import Launcher, meta_key
from perflab_kernels.triton.rows import warps_for

# The gradient cast computes dG and dU from three tensors a chunk. A row of LLaMA 3.2 1B's hidden
# width in one pass at 32 warps beat two chunks at 8 warps (the second pass re-reading the row) and
# was level with 16 warps; rows wider than GRAD_BLOCK go in chunks. Both casts here take one row a
# program on a GPU (fp8_linear's ROWWISE_ROWS).
GRAD_BLOCK = 8192
GRAD_WARPS = {8192: 32, 4096: 8}  # by the block's width, below 4096: 4


@triton.jit
def _rowwise_pair_e4m3(A, B, Y, INV, NA, M, K, stride_a, stride_b, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr):
    """Rows of [A; B] (A's NA rows, then B's; M in all) cast rowwise into one e4m3 Y (a scale a row,
    INV): two weights as one GEMM operand, with no copy stacking them. ROWS rows a program."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_mask = rows < M
    src = tl.where(rows < NA, A + rows * stride_a, B + (rows - NA) * stride_b)
    cols = tl.arange(0, BLOCK)
    amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
    for c in range(CHUNKS):
        offs = c * BLOCK + cols
        mask = row_mask[:, None] & (offs < K)[None, :]
        amax = tl.maximum(amax, tl.abs(tl.load(src[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)))
    scale, inv = pow2_scale(tl.max(amax, axis=1))
    for c in range(CHUNKS):
        offs = c * BLOCK + cols
        mask = row_mask[:, None] & (offs < K)[None, :]
        x = tl.load(src[:, None] + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        tl.store(Y + rows[:, None] * K + offs[None, :], e4m3_rne(x * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
    tl.store(INV + rows, inv, mask=row_mask)


@triton.jit
def _swiglu_grads(DH, GU, rows, offs, stride_dh, stride_gu, H, mask):
    """(dG, dU) at rows x offs, fp32, each rounded to the activations' dtype as eager's backward of
    silu(G) * U stores it: dU = dH * silu(G) (silu(G) as stored), dG = SiLU's backward of dH * U."""
    dh = tl.load(DH + rows[:, None] * stride_dh + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    g = tl.load(GU + rows[:, None] * stride_gu + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    u = tl.load(GU + rows[:, None] * stride_gu + H + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    dtype = DH.dtype.element_ty
    du = _as_stored(dh * _act(g, 1, dtype), dtype)
    dg = _silu_grad(_as_stored(dh * u, dtype), g, dtype)
    return dg, du


@triton.jit
def _swiglu_grad_e4m3(DH, GU, Y, INV, M, H, stride_dh, stride_gu, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr):
    """ROWS rows a program: [dG | dU] (2H wide) from dH (H wide) and [G | U] (GU, 2H wide), cast to e4m3
    with one scale a row (INV its inverse), as rowwise_e4m3 casts the concatenation."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK)
    out = Y + rows[:, None] * 2 * H
    if CHUNKS == 1:
        mask = row_mask[:, None] & (cols < H)[None, :]
        dg, du = _swiglu_grads(DH, GU, rows, cols, stride_dh, stride_gu, H, mask)
        scale, inv = pow2_scale(tl.maximum(tl.max(tl.abs(dg), axis=1), tl.max(tl.abs(du), axis=1)))
        tl.store(out + cols[None, :], e4m3_rne(dg * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
        tl.store(out + H + cols[None, :], e4m3_rne(du * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            dg, du = _swiglu_grads(DH, GU, rows, offs, stride_dh, stride_gu, H, row_mask[:, None] & (offs < H)[None, :])
            amax = tl.maximum(amax, tl.maximum(tl.abs(dg), tl.abs(du)))
        scale, inv = pow2_scale(tl.max(amax, axis=1))
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = row_mask[:, None] & (offs < H)[None, :]
            dg, du = _swiglu_grads(DH, GU, rows, offs, stride_dh, stride_gu, H, mask)
            tl.store(out + offs[None, :], e4m3_rne(dg * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
            tl.store(out + H + offs[None, :], e4m3_rne(du * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
    tl.store(INV + rows, inv, mask=row_mask)


_launch_pair, _launch_grad = Launcher(_rowwise_pair_e4m3), Launcher(_swiglu_grad_e4m3)


def rowwise_pair_e4m3(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y8, inv): rowwise_e4m3 of torch.cat([a, b]) ((NA + NB, K), the same bits), without the
    concatenation written."""
    a = a if a.stride(-1) == 1 else a.contiguous()
    b = b if b.stride(-1) == 1 else b.contiguous()
    if a.shape[1] != b.shape[1]:
        raise ValueError(f"rowwise_pair_e4m3 stacks rows of one width; got {tuple(a.shape)} and {tuple(b.shape)}")
    k = a.shape[1]
    rows = a.shape[0] + b.shape[0]
    y = torch.empty((rows, k), dtype=E4M3, device=a.device)
    inv = torch.empty((rows, 1), dtype=torch.float32, device=a.device)
    block = min(triton.next_power_of_2(k), MAX_BLOCK)
    tile = rows_per_tile(1, a.is_cuda)
    meta = dict(BLOCK=block, CHUNKS=triton.cdiv(k, block), ROWS=tile, num_warps=warps_for(block, ROWWISE_WARPS))
    _launch_pair.launch((triton.cdiv(rows, tile),), (a, b, y, inv, a.shape[0], rows, k, a.stride(0), b.stride(0)), meta, meta_key(meta))
    return y, inv


def swiglu_grad_e4m3(dh: torch.Tensor, gu: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(y8, inv): the gradient of [G | U] (gu, (M, 2H)) through silu(G) * U, given dH (M, H), cast
    rowwise as rowwise_e4m3 casts torch.cat([dG, dU], -1) with dG, dU rounded to dH's dtype."""
    dh = dh if dh.stride(-1) == 1 else dh.contiguous()
    gu = gu if gu.stride(-1) == 1 else gu.contiguous()
    m, h = dh.shape
    if gu.shape != (m, 2 * h):
        raise ValueError(f"swiglu_grad_e4m3 reads [G | U] of shape {(m, 2 * h)} beside dH {(m, h)}; got {tuple(gu.shape)}")
    y = torch.empty((m, 2 * h), dtype=E4M3, device=dh.device)
    inv = torch.empty((m, 1), dtype=torch.float32, device=dh.device)
    block = min(triton.next_power_of_2(h), GRAD_BLOCK)
    tile = rows_per_tile(1, dh.is_cuda)
    meta = dict(BLOCK=block, CHUNKS=triton.cdiv(h, block), ROWS=tile, num_warps=warps_for(block, GRAD_WARPS))
    if m:
        _launch_grad.launch((triton.cdiv(m, tile),), (dh, gu, y, inv, m, h, dh.stride(0), gu.stride(0)), meta, meta_key(meta))
    return y, inv


class Float8SwiGLUFunction(torch.autograd.Function):
    """down(silu(x gate^T) * (x up^T)) with every GEMM in float8, forward and backward as the module
    docstring says; returns the MLP's output, and the three weights' gradients in their dtype."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, w_gate: torch.Tensor, w_up: torch.Tensor, w_down: torch.Tensor, fast_accum_backward: bool = False) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        hidden = w_gate.shape[0]
        x8, x_inv = rowwise_e4m3(x2)
        xt8, _, xt_inv = transposed_e4m3(x2, x_inv, None, x8)
        w13_8, w13_inv = rowwise_pair_e4m3(w_gate, w_up)
        gu = torch._scaled_mm(x8, w13_8.t(), scale_a=x_inv, scale_b=w13_inv.view(1, -1), out_dtype=x.dtype, use_fast_accum=True)
        h8, h_inv = rowwise_e4m3(gu[:, :hidden], "swiglu", gu[:, hidden:])
        ht8, _, ht_inv = transposed_from_rowwise(h8, h_inv)
        wd8, wd_inv = rowwise_e4m3(w_down)
        y = torch._scaled_mm(h8, wd8.t(), scale_a=h_inv, scale_b=wd_inv.view(1, -1), out_dtype=x.dtype, use_fast_accum=True)
        ctx.save_for_backward(xt8, xt_inv, gu, ht8, ht_inv, w13_8, w13_inv, w_down, wd_inv)
        ctx.hidden, ctx.weight_dtype, ctx.fast_accum = hidden, w_gate.dtype, fast_accum_backward
        return y.view(*x.shape[:-1], w_down.shape[0])

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        xt8, xt_inv, gu, ht8, ht_inv, w13_8, w13_inv, w_down, wd_inv = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dy8, dy_inv = rowwise_e4m3(dy2)
        dyt8, _, dyt_inv = transposed_e4m3(dy2, dy_inv, w8=dy8)
        dw_down = torch._scaled_mm(dyt8, ht8.t(), scale_a=dyt_inv, scale_b=ht_inv, out_dtype=w_down.dtype, use_fast_accum=ctx.fast_accum)
        wdt8, wdt_inv, _ = transposed_e4m3(w_down, wd_inv)
        dh = torch._scaled_mm(dy8, wdt8.t(), scale_a=dy_inv, scale_b=wdt_inv, out_dtype=dy.dtype, use_fast_accum=ctx.fast_accum)
        dgu8, dgu_inv = swiglu_grad_e4m3(dh, gu)
        dgut8, _, dgut_inv = transposed_from_rowwise(dgu8, dgu_inv)
        dw13 = torch._scaled_mm(dgut8, xt8.t(), scale_a=dgut_inv, scale_b=xt_inv, out_dtype=ctx.weight_dtype, use_fast_accum=ctx.fast_accum)
        w13t8, w13t_inv, _ = transposed_from_rowwise(w13_8, w13_inv)
        dx = torch._scaled_mm(dgu8, w13t8.t(), scale_a=dgu_inv, scale_b=w13t_inv, out_dtype=dy.dtype, use_fast_accum=ctx.fast_accum)
        return dx.view(*dy.shape[:-1], w13t8.shape[0]), dw13[: ctx.hidden], dw13[ctx.hidden:], dw_down, None


class Float8SwiGLUForward:
    """The forward a folded SwiGLU MLP takes (placed before its own class by `fold_swiglu`): its
    gate, up and down weights through Float8SwiGLUFunction; the modules and parameters stay."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Float8SwiGLUFunction.apply(x, self.gate.weight, self.up.weight, self.down.weight, self.down.fast_accum_backward)


_FOLDED: dict[type, type] = {}


def foldable(mlp: nn.Module) -> bool:
    """Whether `mlp`'s gate, up and down are Float8RowwiseLinear of the recipe the function runs
    (float8 grad weight, no bias, no activation of their own) of matching shapes."""
    linears = [getattr(mlp, name, None) for name in ("gate", "up", "down")]
    if not all(type(m) is Float8RowwiseLinear and m.float8_grad_weight and m.bias is None and m.act is None and m.act_out is None for m in linears):
        return False
    if len({m.fast_accum_backward for m in linears}) > 1:
        return False
    gate, up, down = linears
    return gate.weight.shape == up.weight.shape and down.weight.shape == gate.weight.shape[::-1]


def fold_swiglu(mlp: nn.Module) -> bool:
    """Make `mlp`, whose forward is down(silu(gate(x)) * up(x)) (the caller knows its class: src/models/layers.py's
    SwiGLUFeedForward), run Float8SwiGLUFunction, where `foldable`. Its class is swapped for a subclass
    with Float8SwiGLUForward's forward (one per MLP class, kept); returns whether it folded."""
    cls = type(mlp)
    if issubclass(cls, Float8SwiGLUForward) or not foldable(mlp):
        return False
    folded = _FOLDED.get(cls)
    if folded is None:
        folded = _FOLDED[cls] = type(f"Float8{cls.__name__}", (Float8SwiGLUForward, cls), {"__module__": cls.__module__})
    mlp.__class__ = folded
    return True
