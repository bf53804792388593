"""A linear layer whose output and grad-input GEMMs run in float8 e4m3 with rowwise scales, each
operand cast in one pass by a Triton kernel; the grad-weight GEMM stays in the input's dtype.

This is torchao's `rowwise_with_gw_hp` recipe (the output GEMM with fast accumulation, the
grad-input GEMM without unless `fast_accum_backward`; scales rounded down to powers of two), with the
casts written by hand:

- output: Y = X W^T as `torch._scaled_mm(x8, w8^T)`, x8 a scale a row of X (one program a row
  reads X once and writes x8 and its scale), w8 a scale a row of W (an output feature's).
- grad input: dX = dY W as `_scaled_mm(dy8, w8t^T)`, dy8 a scale a row of dY, w8t = W^T cast with
  one scale for the whole weight (the largest of its row amaxes, known from the forward's cast),
  tile by tile, transposed in registers.
- grad weight: dW = dY^T X in the input's dtype (`rowwise_with_gw_hp`): no transposed casts of
  the activations. Or, `rowwise_with_gw_tensorwise`, in float8 as `_scaled_mm(dyt8, xt8^T)` on
  dY^T and X^T cast with one scale each (the largest of their rows' scales, known from their
  rowwise casts, so each is one more pass, over the rowwise casts' e4m3 bytes: TRANSPOSE_FROM):
  the forward keeps X^T in float8 for it instead of X.

An activation can be applied inside the casts of X (`act="silu"`): the linear then takes the
activation's input U and casts silu(U), each element rounded to U's dtype first, as the activation's
own kernel would store it. The seed's MLP, down(silu(up(x))), loses SiLU's pass over the hidden
activations (read U, write X), since X's rowwise cast reads U in its place (and X^T is cast from its
bytes). The fold pays because the casts round by the GPU's conversion: while they rounded by the
bits, the cast's extra arithmetic took back about as much as the pass saved.
Backward returns dU = dX * silu'(U) from the U it keeps, which the separate SiLU kept too; or, where
up is a float8 linear as well (`fold_mlp_activation` pairs them: up's `act_out`, down's
`act_grad_by_producer`), down returns dX and up's cast of dY takes SiLU's gradient from U as it reads it
(`act="silu_grad"`), so dU is not written either.

dY is cast where autograd leaves it. A linear whose output is handed on in pieces (`split_forward`:
attention's in_proj, whose q, k and v are chunks of one GEMM) gets their gradients apart, and the cast
reads them side by side (`rowwise_e4m3_pieces`) instead of after a copy stacking them; with a bias the
same pass sums dY's columns for its gradient, so neither the stacking copy nor a separate read for
the bias runs.

Each scale is the largest power of two s with amax * s <= 448 (e4m3's largest finite value), so
scaling is exact and the inverse handed to _scaled_mm is exact too. The cast rounds to nearest,
ties to even: on a GPU by the conversion itself (cvt.rn), under Triton's interpreter in integer
arithmetic first (`e4m3_rne`), because the interpreter converts float32 to e4m3 with ties away from
zero and a wrong carry (-124.5 became -64 on Triton 3.6). Both give the same bits.

The float8 GEMMs are faster than bf16 ones (benchmarks/fp8_gemms.py times a mini_llm block's both
ways), but the casts decide whether the step keeps the gain: torchao's casts for the same recipe,
compiled by Inductor, gave back most of it, hence these. Eager blocks launch the casts from Python,
about 12 launches a linear, and are host-bound: use compiled ones
(kernels=compile; kernels=auto times the float8 block both ways and compiles it).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

import triton
import triton.language as tl
from perflab_kernels.triton.device import device_index, pipeline_stages, rows_per_tile, sm_count
from perflab_kernels.triton.launch import Launcher, meta_key
from perflab_kernels.triton.rounding import (  # by name in the kernels: kernels/triton/pdl.py says why
    INTERPRETED,
    bf16_rne,
)
from perflab_kernels.triton.rows import warps_for

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # e4m3's largest finite value; pow2_scale's bit constants encode it as 1.75 * 2**8
# A row of more than this many elements is cast in chunks (two passes: its amax, then the cast)
# instead of held in registers; 8192 (mini_llm's MLP width) is one pass.
MAX_BLOCK = 8192
# Launch settings, swept at a mini_llm block's shapes by benchmarks/fp8_casts.py on a GPU.
# Rowwise: rows a program (a (ROWS, BLOCK) tile, loads in flight together) and warps by block width.
ROWWISE_ROWS = 1
ROWWISE_WARPS = {4096: 8}  # below the smallest width listed: 4
# Transposed: a (BN, BK) tile of the source a program, read along its rows (BK elements) and written
# along W^T's (BN bytes of e4m3 a row). TRANSPOSE_OF says which tile is transposed in registers:
# "e4m3" the cast one (1 byte an element through shared memory), "fp32" the scaled one before the
# cast, "input" the one as loaded (bf16); the same bits every way, each element is cast on its own.
# TRANSPOSE_TMA moves the tiles by Hopper's tensor memory accelerator (host-made descriptors; where
# the shapes allow it, sm90+) instead of per-thread loads and stores, for casts that read the bf16 operand.
# benchmarks/fp8_casts.py --sweep transposed times these: this tile and warps beat 4 warps walking
# down the columns and every other tile; where the transpose happens barely matters, and TMA was
# slower, so it stays off.
TRANSPOSE_TILE = (64, 64)
TRANSPOSE_WARPS = 8
TRANSPOSE_OF = "input"
TRANSPOSE_OFS = ("e4m3", "fp32", "input")
TRANSPOSE_TMA = False
# The order programs take tiles in, as they are launched: "down" a column stripe of the source (all
# its rows), then the next stripe; "across" a block of rows (all its columns), then the next block;
# "across_from_end" the same from the last block of rows up. The linear casts X^T (and dY^T) right
# after X's rowwise cast, whose last programs read the last rows: walked from the end, the first
# tiles are the ones L2 still holds (at mini_llm's shapes a bf16 operand is smaller than L2).
TRANSPOSE_WALK = "across_from_end"
WALKS = ("down", "across", "across_from_end")
# What the transposed casts of X and dY read: "input", the bf16 operand (2 bytes an element), or
# "e4m3", the rowwise cast's output and its rows' scales (1 byte an element, written just before,
# so partly still in L2). Every scale is a power of two and the tensor's is the smallest of the
# rows', so a rowwise e4m3 value times 2**-k is the tensor-scaled value already rounded: the same
# bits as the cast of the input, except where the result is one of e4m3's subnormals and the first
# rounding landed on a tie of the second (then one subnormal step, 2**-9 of the scaled value, apart).
# W^T reads W: its rowwise cast in forward is not kept for backward.
TRANSPOSE_FROM = "e4m3"
TRANSPOSE_FROMS = ("input", "e4m3")
# The cast from e4m3 bytes takes its own tile and warps (TRANSPOSE_OF and the walk are shared): with the
# bf16 cast's tile, at one byte an element, reads rows of only 64 bytes; a wider tile with fewer
# warps was the fastest setting of benchmarks/fp8_casts.py --sweep from.
FROM_E4M3_TILE = (128, 128)
FROM_E4M3_WARPS = 4
# What the rowwise cast may apply first (ACT, the index): none, SiLU (`act="silu"`, the casts of X),
# SiLU's gradient ("silu_grad", the cast of dY: the tensor read is d silu(U), and U is read beside
# it, so dU = d silu(U) * silu'(U) is cast as it is computed and never stored), or SwiGLU ("swiglu":
# the tensor read is the gate G, the up projection's output U is read beside it, and silu(G) * U is
# cast; kernels/triton/fp8_swiglu.py).
ACTS = (None, "silu", "silu_grad", "swiglu")
# dY's rowwise cast where the linear has a bias, or where its output was handed on in pieces
# (`split_forward`: in_proj's q, k and v): each program walks a fixed share of rows, SUM_STAGES rows'
# loads in flight (tl.range num_stages), casting each row as _rowwise_e4m3 does from up to MAX_PIECES
# tensors read side by side, and keeps its column sums as one fp32 row of partials, summed after (the
# RMSNorm backward's dw, kernels/triton/rms_norm.py). So in_proj's dq, dk, dv are cast where attention's
# backward wrote them, and the bias gradient comes out of the same read, where Inductor had stacked
# them into one tensor, read them again for the bias, and summed out_proj's dY for its bias apart.
# The row loop reads slower than one program a row, which the saved passes more than repay; these
# settings were within 0.2% of the best of benchmarks/fp8_casts.py --sweep dy, and one stage (the
# loop as written) clearly slower.
SUM_PROGRAMS_PER_SM = 2
SUM_STAGES = 4
SUM_WARPS = 8
MAX_PIECES = 3
# The rowwise cast of dY with SiLU's gradient (act="silu_grad") reads two tensors and computes an
# exponential and a division an element: warps by block width, apart from the plain cast's (at the
# widest block every count of warps was level within 0.6%, --sweep dy).
SILU_GRAD_WARPS = {4096: 8}


@triton.jit
def _as_stored(x, dtype: tl.constexpr):
    """x (fp32) rounded to `dtype` as a torch kernel storing it would (bf16 to nearest even: bf16_rne,
    as the interpreter's cast truncates), back in fp32."""
    if dtype == tl.bfloat16:
        x = bf16_rne(x).to(tl.float32)
    elif dtype != tl.float32:
        x = x.to(dtype).to(tl.float32)
    return x


@triton.jit
def _act(x, ACT: tl.constexpr, dtype: tl.constexpr):
    """x (fp32) through the activation ACT (0: none, 1: SiLU), rounded to `dtype` as the
    activation's own kernel would store it, back in fp32."""
    if ACT == 1:
        # x / (1 + e^-x), torch's formula, with the division approximate (div.full.f32, 2 ulp): an IEEE
        # division is a dozen instructions an element, and two casts of the hidden activations run it
        x = _as_stored(tl.fdiv(x, 1.0 + tl.exp(-x), ieee_rounding=False), dtype)
    return x


@triton.jit
def _silu_grad(dh, u, dtype: tl.constexpr):
    """dU = dH * silu'(U) (fp32 in, fp32 out), aten's silu_backward: s = 1 / (1 + e^-u), dH * s * (1 + u *
    (1 - s)), the division approximate as in _act, rounded to `dtype` as that kernel stores it."""
    sig = tl.fdiv(tl.full(u.shape, 1.0, tl.float32), 1.0 + tl.exp(-u), ieee_rounding=False)
    return _as_stored(dh * sig * (1.0 + u * (1.0 - sig)), dtype)


@triton.jit
def _rowwise_load(X, G, rows, offs, stride_x, stride_g, mask, ACT: tl.constexpr):
    """The rowwise cast's input tile in fp32: X's, through ACT (ACTS; silu_grad and swiglu also read G:
    U for the one, the up projection's output for the other). SwiGLU rounds as eager's silu(G) * U
    stores: silu(G) to X's dtype, then the product."""
    x = tl.load(X + rows[:, None] * stride_x + offs[None, :], mask=mask, other=0.0).to(tl.float32)
    if ACT == 2:
        return _silu_grad(x, tl.load(G + rows[:, None] * stride_g + offs[None, :], mask=mask, other=0.0).to(tl.float32), X.dtype.element_ty)
    if ACT == 3:
        up = tl.load(G + rows[:, None] * stride_g + offs[None, :], mask=mask, other=0.0).to(tl.float32)
        return _as_stored(_act(x, 1, X.dtype.element_ty) * up, X.dtype.element_ty)
    return _act(x, ACT, X.dtype.element_ty)


@triton.jit
def e4m3_rne(v):
    """v (fp32, |v| <= 448) as fp32 whose conversion to e4m3 is v's nearest e4m3 value, ties to even.
    On a GPU that is v (the conversion rounds so); under the interpreter v rounded here: three mantissa
    bits kept with the carry into the exponent, or e4m3's subnormal step of 2**-9 below 2**-6."""
    if INTERPRETED:
        bits = v.to(tl.int32, bitcast=True)
        lsb = (bits >> 20) & 1
        normal = ((bits + 0x7FFFF + lsb) & -1048576).to(tl.float32, bitcast=True)
        # 1.5 * 2**14: fp32's spacing between 2**14 and 2**15 is 2**-9, so the add rounds |v| there
        sub = ((tl.abs(v) + 24576.0) - 24576.0).to(tl.int32, bitcast=True) | (bits & -2147483648)  # the sign kept, -0 too
        v = tl.where(tl.abs(v) < 0.015625, sub.to(tl.float32, bitcast=True), normal)
    return v


@triton.jit
def pow2_scale(amax):
    """(s, 1/s): the largest power of two s with amax * s <= 448, from amax's exponent and
    mantissa bits (448 = 1.75 * 2**8), so no division or log rounds it. amax floors at 1e-12 (an
    all-zero row), torchao's floor."""
    bits = tl.maximum(amax, 1e-12).to(tl.int32, bitcast=True)
    k = 8 - (((bits >> 23) & 0xFF) - 127) - ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
    return ((k + 127) << 23).to(tl.float32, bitcast=True), ((127 - k) << 23).to(tl.float32, bitcast=True)


@triton.jit
def pow2_reciprocal(x):
    """1 / x for x a power of two (a scale or its inverse), exact, from the exponent bits alone."""
    return ((254 << 23) - x.to(tl.int32, bitcast=True)).to(tl.float32, bitcast=True)


@triton.jit
def _rowwise_e4m3(X, G, Y, INV, M, N, stride_x, stride_g, BLOCK: tl.constexpr, CHUNKS: tl.constexpr, ROWS: tl.constexpr, ACT: tl.constexpr):
    """ROWS rows a program: each row's amax, then y = rne(x * s) and 1/s; x = act(X) (ACT,
    _rowwise_load; G read only by silu_grad)."""
    rows = (tl.program_id(0) * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    row_mask = rows < M
    cols = tl.arange(0, BLOCK)
    if CHUNKS == 1:
        mask = row_mask[:, None] & (cols < N)[None, :]
        x = _rowwise_load(X, G, rows, cols, stride_x, stride_g, mask, ACT)
        scale, inv = pow2_scale(tl.max(tl.abs(x), axis=1))
        tl.store(Y + rows[:, None] * N + cols[None, :], e4m3_rne(x * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
    else:
        amax = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = row_mask[:, None] & (offs < N)[None, :]
            amax = tl.maximum(amax, tl.abs(_rowwise_load(X, G, rows, offs, stride_x, stride_g, mask, ACT)))
        scale, inv = pow2_scale(tl.max(amax, axis=1))
        for c in range(CHUNKS):
            offs = c * BLOCK + cols
            mask = row_mask[:, None] & (offs < N)[None, :]
            x = _rowwise_load(X, G, rows, offs, stride_x, stride_g, mask, ACT)
            tl.store(Y + rows[:, None] * N + offs[None, :], e4m3_rne(x * scale[:, None]).to(Y.dtype.element_ty), mask=mask)
    tl.store(INV + rows, inv, mask=row_mask)


@triton.jit
def _tile_of(N, K, BN: tl.constexpr, BK: tl.constexpr, WALK: tl.constexpr):
    """(pn, pk): this program's tile, in the order WALK (0 down, 1 across, 2 across from the end:
    TRANSPOSE_WALK)."""
    pid = tl.program_id(0)
    n_tiles = tl.cdiv(N, BN)
    k_tiles = tl.cdiv(K, BK)
    if WALK == 0:
        pn = pid % n_tiles
        pk = pid // n_tiles
    else:
        pn = pid // k_tiles
        pk = pid % k_tiles
        if WALK == 2:
            pn = n_tiles - 1 - pn
    return pn, pk


@triton.jit
def _cast_transposed(w, inv_max, OF: tl.constexpr, out_dtype: tl.constexpr):
    """The (BN, BK) tile `w` as loaded, times 1 / inv_max, in e4m3 and transposed to (BK, BN),
    transposed at the point OF says (0 e4m3, 1 fp32, 2 as loaded: TRANSPOSE_OF)."""
    scale = pow2_reciprocal(inv_max)
    if OF == 0:
        wt8 = tl.trans(e4m3_rne(w.to(tl.float32) * scale).to(out_dtype))
    elif OF == 1:
        wt8 = e4m3_rne(tl.trans(w.to(tl.float32) * scale)).to(out_dtype)
    else:
        wt8 = e4m3_rne(tl.trans(w).to(tl.float32) * scale).to(out_dtype)
    return wt8


@triton.jit
def _store_scale_b(INV, inv_max, pn, pk, K, BK: tl.constexpr):
    """The first row of tiles writes inv_max over its BK columns of INV: the (1, K) scale_b of a
    rowwise _scaled_mm, one value repeated."""
    if pn == 0:
        rk = pk * BK + tl.arange(0, BK)
        tl.store(INV + rk, tl.zeros((BK,), dtype=tl.float32) + inv_max, mask=rk < K)


@triton.jit
def _transposed_e4m3(W, WT, INV_MAX, INV, N, K, BN: tl.constexpr, BK: tl.constexpr, OF: tl.constexpr, WALK: tl.constexpr, EVEN: tl.constexpr,
                     ACT: tl.constexpr):
    """W (N, K) -> act(W)^T (K, N) in e4m3 with one scale, 1 / INV_MAX (the largest of the rows'
    inverse scales: the scale of the largest row amax), one (BN, BK) tile a program; EVEN: every
    tile whole, no masks; ACT: _act's, on the tile as loaded. The first row of tiles writes INV_MAX
    K times (INV, the (1, K) scale_b _scaled_mm takes)."""
    pn, pk = _tile_of(N, K, BN, BK, WALK)
    inv_max = tl.load(INV_MAX)
    rn = pn * BN + tl.arange(0, BN)
    rk = pk * BK + tl.arange(0, BK)
    if EVEN:
        w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :])
        if ACT != 0:
            w = _act(w.to(tl.float32), ACT, W.dtype.element_ty).to(W.dtype.element_ty)
        tl.store(WT + rk[:, None].to(tl.int64) * N + rn[None, :], _cast_transposed(w, inv_max, OF, WT.dtype.element_ty))
    else:
        mask = (rn < N)[:, None] & (rk < K)[None, :]
        w = tl.load(W + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0)
        if ACT != 0:
            w = _act(w.to(tl.float32), ACT, W.dtype.element_ty).to(W.dtype.element_ty)
        tl.store(WT + rk[:, None].to(tl.int64) * N + rn[None, :], _cast_transposed(w, inv_max, OF, WT.dtype.element_ty), mask=tl.trans(mask))
    _store_scale_b(INV, inv_max, pn, pk, K, BK)


@triton.jit
def _transposed_e4m3_tma(W_DESC, WT_DESC, INV_MAX, INV, N, K, BN: tl.constexpr, BK: tl.constexpr, OF: tl.constexpr, WALK: tl.constexpr, ACT: tl.constexpr):
    """_transposed_e4m3 with the tiles moved by TMA: W_DESC loads (BN, BK) tiles of W (zeros past
    its edges), WT_DESC stores (BK, BN) tiles of W^T (clipped at its edges)."""
    pn, pk = _tile_of(N, K, BN, BK, WALK)
    inv_max = tl.load(INV_MAX)
    w = W_DESC.load([pn * BN, pk * BK])
    if ACT != 0:
        w = _act(w.to(tl.float32), ACT, w.dtype).to(w.dtype)
    WT_DESC.store([pk * BK, pn * BN], _cast_transposed(w, inv_max, OF, tl.float8e4nv))
    _store_scale_b(INV, inv_max, pn, pk, K, BK)


@triton.jit
def _transposed_e4m3_from_rowwise(Q, INV_ROW, WT, INV_MAX, INV, N, K, BN: tl.constexpr, BK: tl.constexpr, OF: tl.constexpr, WALK: tl.constexpr,
                                  EVEN: tl.constexpr):
    """_transposed_e4m3 reading the rowwise cast of W instead of W: Q (N, K) e4m3 with INV_ROW (N,)
    its rows' inverse scales. Each value is rescaled by 2**-k = INV_ROW / INV_MAX (exact: powers of
    two, k >= 0) and rounded again; OF 2 transposes the tile of bytes as loaded, 0 and 1 the recast one."""
    pn, pk = _tile_of(N, K, BN, BK, WALK)
    inv_max = tl.load(INV_MAX)
    scale = pow2_reciprocal(inv_max)
    rn = pn * BN + tl.arange(0, BN)
    rk = pk * BK + tl.arange(0, BK)
    if EVEN:
        q = tl.load(Q + rn[:, None].to(tl.int64) * K + rk[None, :])
        factor = tl.load(INV_ROW + rn) * scale
    else:
        mask = (rn < N)[:, None] & (rk < K)[None, :]
        q = tl.load(Q + rn[:, None].to(tl.int64) * K + rk[None, :], mask=mask, other=0.0)
        factor = tl.load(INV_ROW + rn, mask=rn < N, other=0.0) * scale
    if OF == 2:
        wt8 = e4m3_rne(tl.trans(q).to(tl.float32) * factor[None, :]).to(WT.dtype.element_ty)
    else:
        wt8 = tl.trans(e4m3_rne(q.to(tl.float32) * factor[:, None]).to(WT.dtype.element_ty))
    if EVEN:
        tl.store(WT + rk[:, None].to(tl.int64) * N + rn[None, :], wt8)
    else:
        tl.store(WT + rk[:, None].to(tl.int64) * N + rn[None, :], wt8, mask=tl.trans(mask))
    _store_scale_b(INV, inv_max, pn, pk, K, BK)


@triton.jit
def _rowwise_e4m3_pieces(X0, X1, X2, Y, INV, PART, M, NP, stride0, stride1, stride2, rows_per_program, BLOCK: tl.constexpr, PIECES: tl.constexpr,
                         SUM: tl.constexpr, STAGES: tl.constexpr):
    """_rowwise_e4m3 of the row-wise concatenation [X0 | X1 | X2][:, :PIECES * NP] (each (M, NP), rows
    `stride` apart) into Y (M, PIECES * NP), rows_per_program rows a program; with SUM, the program's
    column sums (fp32) stored as its row of PART."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < NP
    n = NP * PIECES
    acc0 = tl.zeros((BLOCK,), dtype=tl.float32)
    acc1 = tl.zeros((BLOCK,), dtype=tl.float32)
    acc2 = tl.zeros((BLOCK,), dtype=tl.float32)
    start = pid.to(tl.int64) * rows_per_program  # an int64 loop: the rows' offsets below are too
    end = tl.minimum(start + rows_per_program, M)
    for r in tl.range(start, end, num_stages=STAGES):
        x0 = tl.load(X0 + r * stride0 + cols, mask=mask, other=0.0).to(tl.float32)
        amax = tl.max(tl.abs(x0), axis=0)
        if PIECES > 1:
            x1 = tl.load(X1 + r * stride1 + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x1), axis=0))
        if PIECES > 2:
            x2 = tl.load(X2 + r * stride2 + cols, mask=mask, other=0.0).to(tl.float32)
            amax = tl.maximum(amax, tl.max(tl.abs(x2), axis=0))
        scale, inv = pow2_scale(amax)
        out = Y + r * n + cols
        tl.store(out, e4m3_rne(x0 * scale).to(Y.dtype.element_ty), mask=mask)
        if SUM:
            acc0 += x0
        if PIECES > 1:
            tl.store(out + NP, e4m3_rne(x1 * scale).to(Y.dtype.element_ty), mask=mask)
            if SUM:
                acc1 += x1
        if PIECES > 2:
            tl.store(out + 2 * NP, e4m3_rne(x2 * scale).to(Y.dtype.element_ty), mask=mask)
            if SUM:
                acc2 += x2
        tl.store(INV + r, inv)
    if SUM:
        part = PART + pid.to(tl.int64) * n + cols
        tl.store(part, acc0, mask=mask)
        if PIECES > 1:
            tl.store(part + NP, acc1, mask=mask)
        if PIECES > 2:
            tl.store(part + 2 * NP, acc2, mask=mask)


_launch_rowwise, _launch_transposed = Launcher(_rowwise_e4m3), Launcher(_transposed_e4m3)
_launch_pieces = Launcher(_rowwise_e4m3_pieces)
_launch_from_rowwise = Launcher(_transposed_e4m3_from_rowwise)


def rowwise_e4m3(x: torch.Tensor, act: str | None = None, u: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(x8, inv): x (M, N) with unit column stride, or act(x) (ACTS), in e4m3, a scale a row; inv
    (M, 1) fp32 = 1/s, the scale_a (or, viewed (1, M), scale_b) _scaled_mm takes. act="silu_grad":
    x is d silu(u), and what is cast is dU = x * silu'(u), u of x's shape. act="swiglu": x is the
    gate, u the up projection's output (x's shape), and what is cast is silu(x) * u."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if act in ("silu_grad", "swiglu") and (u.shape != x.shape or u.stride(-1) != 1):
        if u.shape != x.shape:
            raise ValueError(f"rowwise_e4m3(act={act!r}) reads u beside x, of one shape; got {tuple(x.shape)} and {tuple(u.shape)}")
        u = u.contiguous()
    m, n = x.shape
    y = torch.empty((m, n), dtype=E4M3, device=x.device)
    inv = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    block = min(triton.next_power_of_2(n), MAX_BLOCK)
    chunks = triton.cdiv(n, block)
    rows = rows_per_tile(ROWWISE_ROWS, x.is_cuda)
    meta = dict(BLOCK=block, CHUNKS=chunks, ROWS=rows, ACT=ACTS.index(act), num_warps=warps_for(block, SILU_GRAD_WARPS if act == "silu_grad" else ROWWISE_WARPS))
    g = u if act in ("silu_grad", "swiglu") else x  # read only by silu_grad and swiglu
    _launch_rowwise.launch((triton.cdiv(m, rows),), (x, g, y, inv, m, n, x.stride(0), g.stride(0)), meta, meta_key(meta))
    return y, inv


def rowwise_e4m3_pieces(pieces: Sequence[torch.Tensor], col_sum: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """(y8, inv, sums): the row-wise concatenation of `pieces` (each (M, NP), unit column stride, up to
    MAX_PIECES) cast as `rowwise_e4m3` casts it, the same bits, without the concatenation ever
    written; with `col_sum` also its column sums (fp32, (PIECES * NP,): a bias's gradient before its
    rounding), else None."""
    pieces = [p if p.stride(-1) == 1 else p.contiguous() for p in pieces]
    m, np_ = pieces[0].shape
    if len(pieces) > MAX_PIECES or triton.next_power_of_2(np_) > MAX_BLOCK or any(p.shape != (m, np_) for p in pieces):
        x = torch.cat(list(pieces), dim=-1)  # beyond the kernel's terms: one tensor, the plain cast
        y, inv = rowwise_e4m3(x)
        return y, inv, (x.float().sum(0) if col_sum else None)
    n = np_ * len(pieces)
    y = torch.empty((m, n), dtype=E4M3, device=pieces[0].device)
    inv = torch.empty((m, 1), dtype=torch.float32, device=pieces[0].device)
    index = device_index(pieces[0])
    rows_per_program = triton.cdiv(m, max(1, min(m, sm_count(index) * SUM_PROGRAMS_PER_SM)))
    programs = triton.cdiv(m, rows_per_program) if m else 0
    part = torch.empty((programs, n), dtype=torch.float32, device=y.device) if col_sum else inv
    block = triton.next_power_of_2(np_)
    stages = pipeline_stages(SUM_STAGES, len(pieces) * block * pieces[0].element_size(), index)
    meta = dict(BLOCK=block, PIECES=len(pieces), SUM=col_sum, STAGES=stages, num_warps=SUM_WARPS)
    xs = [*pieces, *[pieces[0]] * (MAX_PIECES - len(pieces))]  # unused pointers: the first piece again
    if programs:
        _launch_pieces.launch((programs,), (*xs, y, inv, part, m, np_, *(x.stride(0) for x in xs), rows_per_program), meta, meta_key(meta))
    return y, inv, (part.sum(0) if col_sum else None)


def transposed_e4m3(w: torch.Tensor, row_inv: torch.Tensor, act: str | None = None, w8: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(wt8, inv, inv_max): W^T (K, N), or act(W)^T, in e4m3 with one scale for the tensor, from the
    rows' inverse scales of `rowwise_e4m3(w, act)` (their largest: the scale of the largest amax). inv is that
    1/s repeated (1, K), the scale_b of a rowwise _scaled_mm; inv_max the same 1/s as one value,
    the scale of a tensorwise one. `w8`, that rowwise cast's e4m3 output: where given and
    TRANSPOSE_FROM is "e4m3", it is read in W's place (act already applied in it)."""
    if w8 is not None and TRANSPOSE_FROM == "e4m3":
        return transposed_from_rowwise(w8, row_inv)
    if act not in (None, "silu"):
        raise ValueError(f"transposed_e4m3 applies SiLU at most (act={act!r} reads a second tensor): cast from its rowwise cast (w8)")
    n, k = w.shape
    wt = torch.empty((k, n), dtype=E4M3, device=w.device)
    inv = torch.empty((1, k), dtype=torch.float32, device=w.device)
    inv_max = row_inv.amax()
    bn, bk = TRANSPOSE_TILE
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    meta = dict(BN=bn, BK=bk, OF=TRANSPOSE_OFS.index(TRANSPOSE_OF), WALK=WALKS.index(TRANSPOSE_WALK), num_warps=TRANSPOSE_WARPS,
                ACT=ACTS.index(act))
    w = w.contiguous()
    if TRANSPOSE_TMA and _tma_fits(w, wt):
        from triton.tools.tensor_descriptor import TensorDescriptor

        # kernel[grid]: the cached launch (launch.py) hands the C launcher tensors, not descriptors
        _transposed_e4m3_tma[grid](TensorDescriptor.from_tensor(w, [bn, bk]), TensorDescriptor.from_tensor(wt, [bk, bn]), inv_max, inv, n, k, **meta)
    else:
        meta["EVEN"] = n % bn == 0 and k % bk == 0
        _launch_transposed.launch(grid, (w, wt, inv_max, inv, n, k), meta, meta_key(meta))
    return wt, inv, inv_max


def transposed_from_rowwise(q8: torch.Tensor, row_inv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """transposed_e4m3's (wt8, inv, inv_max) from a rowwise cast alone: q8 (N, K) e4m3 and its rows'
    inverse scales (rowwise_e4m3's), read in place of the tensor they came from (TRANSPOSE_FROM's
    "e4m3"), for a tensor that was never written in its own dtype (the fused MLP's
    kernels/triton/fp8_swiglu.py)."""
    n, k = q8.shape
    wt = torch.empty((k, n), dtype=E4M3, device=q8.device)
    inv = torch.empty((1, k), dtype=torch.float32, device=q8.device)
    inv_max = row_inv.amax()
    bn, bk = FROM_E4M3_TILE
    grid = (triton.cdiv(n, bn) * triton.cdiv(k, bk),)
    meta = dict(BN=bn, BK=bk, OF=TRANSPOSE_OFS.index(TRANSPOSE_OF), WALK=WALKS.index(TRANSPOSE_WALK), num_warps=FROM_E4M3_WARPS,
                EVEN=n % bn == 0 and k % bk == 0)
    _launch_from_rowwise.launch(grid, (q8, row_inv, wt, inv_max, inv, n, k), meta, meta_key(meta))
    return wt, inv, inv_max


def _tma_fits(w: torch.Tensor, wt: torch.Tensor) -> bool:
    """TMA's terms: on a GPU of compute capability 9.0+, both tensors' addresses and row strides
    multiples of 16 bytes (a float8 GEMM's sizes are multiples of 16 anyway)."""
    if w.device.type != "cuda" or torch.cuda.get_device_capability(w.device) < (9, 0):
        return False
    return all(t.data_ptr() % 16 == 0 and (t.stride(0) * t.element_size()) % 16 == 0 for t in (w, wt))


class Float8RowwiseLinearFunction(torch.autograd.Function):
    """y = x W^T + b with float8 output and grad-input GEMMs (the module docstring's recipe); with
    `float8_grad_weight` the grad-weight GEMM too, on dY^T and X^T cast tensorwise. With `act`
    (ACTS) the input is the activation's: y = act(x) W^T + b, act applied inside X's casts."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, float8_grad_weight: bool, act: str | None = None,
                pieces: int = 1, act_out: str | None = None, act_grad_by_producer: bool = False,
                fast_accum_backward: bool = False) -> torch.Tensor | tuple[torch.Tensor, ...]:
        x2 = x.reshape(-1, x.shape[-1])
        x8, x_inv = rowwise_e4m3(x2, act)
        if float8_grad_weight:
            # X^T in float8 is what backward needs of X: kept instead of X (1 byte an element, not 2),
            # cast straight after X's rowwise cast, from its e4m3 bytes while L2 still holds their last rows
            # (TRANSPOSE_FROM, TRANSPOSE_WALK)
            xt8, _, xt_inv = transposed_e4m3(x2, x_inv, act, x8)
        w8, w_inv = rowwise_e4m3(weight)
        # the bias added in the GEMM's epilogue (CUTLASS's rowwise kernel takes a bf16 one): a separate
        # add would read and write the output again, 8192 x 6144 bf16 for qkv (0.2 GB a block)
        y = torch._scaled_mm(x8, w8.t(), scale_a=x_inv, scale_b=w_inv.view(1, -1), bias=bias, out_dtype=x.dtype, use_fast_accum=True)
        kept = {}
        if act and float8_grad_weight and not act_grad_by_producer:
            kept["u"] = x2  # the activation's input: its gradient needs it (the separate activation kept it)
        if act_out:
            kept["out"] = y  # the activation's input here is this output: its gradient is taken in dY's cast
        ctx.save_for_backward(*((xt8, xt_inv, weight, w_inv) if float8_grad_weight else (x2, weight, w_inv)), *kept.values())
        ctx.kept = tuple(kept)
        ctx.has_bias, ctx.float8_grad_weight, ctx.act, ctx.act_grad_by_producer = bias is not None, float8_grad_weight, act, act_grad_by_producer
        ctx.fast_accum = fast_accum_backward
        y = y.view(*x.shape[:-1], weight.shape[0])
        return y if pieces == 1 else y.chunk(pieces, -1)

    @staticmethod
    def backward(ctx, *dys: torch.Tensor):
        # the output's gradient, or its pieces' (pieces > 1), each read where autograd left it: dY as
        # one tensor exists only where a path below needs it in the input's dtype (`whole`)
        rows = [d.reshape(-1, d.shape[-1]) for d in dys]
        saved = ctx.saved_tensors
        kept = dict(zip(ctx.kept, saved[len(saved) - len(ctx.kept):]))
        out = kept.get("out")  # act_out: the gradient arriving is d act(Y), act's gradient is this cast's
        if out is not None and not (ctx.float8_grad_weight and TRANSPOSE_FROM == "e4m3" and len(rows) == 1 and not ctx.has_bias):
            # a path below needs dY in the input's dtype: act's gradient as its own op first
            rows, out = [torch.ops.aten.silu_backward(torch.cat(rows, dim=-1) if len(rows) > 1 else rows[0], out)], None
        if out is not None:
            (dy8, dy_inv), db, whole = rowwise_e4m3(rows[0], "silu_grad", out), None, None
        elif ctx.has_bias or len(rows) > 1:
            dy8, dy_inv, db = rowwise_e4m3_pieces(rows, ctx.has_bias)
            whole = rows[0] if len(rows) == 1 else None
        else:
            (dy8, dy_inv), db, whole = rowwise_e4m3(rows[0]), None, rows[0]
        if ctx.float8_grad_weight:
            xt8, xt_inv, weight, w_inv = saved[:4]
            u = kept.get("u")  # the activation's input, kept for its gradient
            if whole is None and TRANSPOSE_FROM != "e4m3":
                whole = torch.cat(rows, dim=-1)
            # from dY's e4m3 bytes (TRANSPOSE_FROM), dY itself only its shape: the pieces' cast stands in
            dyt8, _, dyt_inv = transposed_e4m3(whole if whole is not None else dy8, dy_inv, w8=dy8)
            dw = torch._scaled_mm(dyt8, xt8.t(), scale_a=dyt_inv, scale_b=xt_inv, out_dtype=weight.dtype, use_fast_accum=ctx.fast_accum)
        else:
            dy2 = whole if whole is not None else torch.cat(rows, dim=-1)
            x2, weight, w_inv = saved[:3]
            u = x2 if ctx.act else None
            x_in = F.silu(u) if ctx.act else x2  # the activation again: only its input was kept
            dw = (dy2.t() @ x_in.to(dy2.dtype)).to(weight.dtype)
        wt8, wt_inv, _ = transposed_e4m3(weight, w_inv)
        dx = torch._scaled_mm(dy8, wt8.t(), scale_a=dy_inv, scale_b=wt_inv, out_dtype=dys[0].dtype, use_fast_accum=ctx.fast_accum)
        if ctx.act and not ctx.act_grad_by_producer:  # the gradient through the activation (SiLU, ACTS' one), as its own backward computes it
            dx = torch.ops.aten.silu_backward(dx, u.to(dx.dtype))
        db = db.to(weight.dtype) if ctx.has_bias else None
        return dx.view(*dys[0].shape[:-1], weight.shape[1]), dw, db, None, None, None, None, None, None


class Float8RowwiseLinear(nn.Linear):
    """nn.Linear with the float8 GEMMs above: the same parameters, so state dicts, FSDP2 sharding
    and checkpoints see the same tensors. Made by swapping an nn.Linear's class (`swap_to_float8`).
    Set by `fold_mlp_activation` on an MLP's pair of linears: `act` (ACTS), the activation this layer
    applies to its input first; `act_out`, the activation applied to this layer's output, which is handed
    on as its input U (the next layer's `act` applies it); `act_grad_by_producer`, this layer's backward
    returns the gradient of act(x), and the layer that made x (its `act_out`) takes act's gradient.
    `fast_accum_backward` (precision.fp8_fast_accum): the grad-input GEMM, and the grad-weight GEMM where it
    is float8, accumulate as the output GEMM does, in the tensor cores' own precision, not promoted to fp32
    along the way."""

    float8_grad_weight = False
    fast_accum_backward = False
    act: str | None = None
    act_out: str | None = None
    act_grad_by_producer = False

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return Float8RowwiseLinearFunction.apply(x, self.weight, self.bias, self.float8_grad_weight, self.act, 1, self.act_out, self.act_grad_by_producer,
                                                 self.fast_accum_backward)

    def split_forward(self, x: torch.Tensor, pieces: int) -> tuple[torch.Tensor, ...]:
        """forward(x).chunk(pieces, -1), the same views, with backward taking the pieces' gradients
        apart: their cast reads each where it lies instead of a copy stacking them into one tensor
        (src/models/mini_llm.py's split_projection asks for it)."""
        return Float8RowwiseLinearFunction.apply(x, self.weight, self.bias, self.float8_grad_weight, self.act, pieces, self.act_out, self.act_grad_by_producer,
                                                 self.fast_accum_backward)

    def extra_repr(self) -> str:
        return super().extra_repr() + (f", act={self.act}" if self.act else "") + (f", act_out={self.act_out}" if self.act_out else "")


def swap_to_float8(linear: nn.Linear, float8_grad_weight: bool = False, fast_accum_backward: bool = False) -> None:
    """Make `linear` a Float8RowwiseLinear in place (its parameters untouched); `float8_grad_weight`
    runs its grad-weight GEMM in float8 too; `fast_accum_backward`, its backward GEMMs with fast accumulation."""
    if type(linear) is not nn.Linear:
        raise TypeError(f"swap_to_float8 takes a plain nn.Linear, not {type(linear).__name__}")
    linear.__class__ = Float8RowwiseLinear
    linear.float8_grad_weight = float8_grad_weight
    linear.fast_accum_backward = fast_accum_backward


def fold_mlp_activation(mlp: nn.Module) -> bool:
    """Fold an MLP's SiLU into its down projection's casts: for a module with `act` an nn.SiLU and
    `down` a Float8RowwiseLinear (the seed's Linear -> SiLU -> Linear, src/models/mini_llm.py's
    FeedForward), `act` becomes nn.Identity and `down` applies SiLU to its input inside X's casts.
    Where `up` is a Float8RowwiseLinear too, SiLU's gradient goes into up's cast of dY: down's
    backward hands back d silu(U), and up's cast reads it beside U, its own output, so dU (8192 x
    8192 bf16 a block at the seed's shapes) is never written and read back. The parameters are
    untouched. Returns whether it folded."""
    act, up, down = getattr(mlp, "act", None), getattr(mlp, "up", None), getattr(mlp, "down", None)
    if type(act) is not nn.SiLU or type(down) is not Float8RowwiseLinear or down.act is not None:
        return False
    mlp.act = nn.Identity()
    down.act = "silu"
    if type(up) is Float8RowwiseLinear and up.act_out is None:
        up.act_out, down.act_grad_by_producer = "silu", True
    return True
