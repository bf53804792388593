"""`torch._chunk_cat(tensors, 0, W, out=out)` in one vectorised pass, casting as it copies.

FSDP2 builds each unit's reduce-scatter input this way after backward: every unsharded gradient is
split into W chunks along dim 0 and row r of `out` (W x N/W) is the concatenation of each gradient's
chunk r, in `out`'s dtype (reduce_dtype). It runs on the compute stream, so it is on the step's
critical path. torch's own copy (torch 2.11) streams well below the copy ceiling, and its casting
one (bf16 -> fp32, the seed's fp32 reduce) at about half of it; this kernel streams near the ceiling
either way.

One launch takes up to SLOTS gradients: a program copies BLOCK elements of one gradient's chunk
(program_id 0, walking the gradients' tiles in order) for one row (program_id 1). Only what
needs no padding is taken: contiguous gradients whose dim 0 divides by W, cast to an equal or wider
float (an exact conversion, so the result is torch's bit for bit); src/speed/reduce_copy_in.py
sends everything else to torch.

With `squares`, each program also leaves the sum of the squares of what it wrote (one fp32 per
program, 2 KB per million elements): on one rank, where this output is the fp32 gradients
themselves (speed.one_rank_copies), clipping's norm is summed here instead of in a pass of its own
over them (speed.norm_in_copy_in, src/speed/grad_squares.py).
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from perflab_kernels.triton.launch import Launcher

# The block and warps of kernels/triton/cast.py, whose sweep found them a little ahead of wider blocks
# at 8 warps; the slots hold a mini_llm block's gradients in one launch.
BLOCK, NUM_WARPS, SLOTS = 2048, 4, 8
MAX_CHUNKS = 65535  # the world size is the grid's second axis, which CUDA caps at 65535
FLOATS = (torch.bfloat16, torch.float16, torch.float32)
WIDENS = {(torch.bfloat16, torch.float32), (torch.float16, torch.float32)}  # exact: every value is kept


@triton.jit
def _tile(OUT, row_stride, X, c, col, lo, hi, S, s_row, s_base, BLOCK: tl.constexpr, SQUARES: tl.constexpr):
    pid = tl.program_id(0)
    if (pid >= lo) & (pid < hi):
        row = tl.program_id(1).to(tl.int64)
        offs = (pid - lo).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < c
        x = tl.load(X + row * c + offs, mask=mask, other=0.0)
        y = x.to(OUT.dtype.element_ty)
        tl.store(OUT + row * row_stride + col + offs, y, mask=mask)
        if SQUARES:
            f = y.to(tl.float32)
            tl.store(S + row * s_row + s_base + pid, tl.sum(f * f, axis=0))


@triton.jit
def _chunk_cat(OUT, row_stride,
               X0, X1, X2, X3, X4, X5, X6, X7,
               C0, C1, C2, C3, C4, C5, C6, C7,
               O0, O1, O2, O3, O4, O5, O6, O7,
               T1, T2, T3, T4, T5, T6, T7, T8,
               S, s_row, s_base,
               NT: tl.constexpr, BLOCK: tl.constexpr, SQUARES: tl.constexpr):
    # slot i: gradient Xi, Ci elements a chunk, its chunk at column Oi of each row, tiles [T(i), T(i+1));
    # SQUARES: tile t of row r leaves its sum of squares at S[r * s_row + s_base + t]
    _tile(OUT, row_stride, X0, C0, O0, 0, T1, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 1:
        _tile(OUT, row_stride, X1, C1, O1, T1, T2, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 2:
        _tile(OUT, row_stride, X2, C2, O2, T2, T3, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 3:
        _tile(OUT, row_stride, X3, C3, O3, T3, T4, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 4:
        _tile(OUT, row_stride, X4, C4, O4, T4, T5, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 5:
        _tile(OUT, row_stride, X5, C5, O5, T5, T6, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 6:
        _tile(OUT, row_stride, X6, C6, O6, T6, T7, S, s_row, s_base, BLOCK, SQUARES)
    if NT > 7:
        _tile(OUT, row_stride, X7, C7, O7, T7, T8, S, s_row, s_base, BLOCK, SQUARES)


_launch = Launcher(_chunk_cat)  # kernels/triton/launch.py: cached launches


def takes(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> bool:
    """Whether `chunk_cat` does this call as torch would: one device (the current one) and source
    dtype, contiguous, non-empty (torch refuses an empty one), dim 0 divisible by num_chunks (no
    padding) and at most MAX_CHUNKS of them, an equal or wider float out of the exact size."""
    if not tensors or not 1 <= num_chunks <= MAX_CHUNKS or not out.is_contiguous() or out.dtype not in FLOATS:
        return False
    if out.is_cuda and out.device.index != torch.cuda.current_device():  # launched on the current device's stream
        return False
    dtype = tensors[0].dtype
    if dtype not in FLOATS or (dtype != out.dtype and (dtype, out.dtype) not in WIDENS):
        return False
    total = 0
    for t in tensors:
        if t.dtype != dtype or t.device != out.device or not t.is_contiguous() or t.dim() == 0 or t.numel() == 0 or t.shape[0] % num_chunks:
            return False
        total += t.numel()
    return total == out.numel()


def chunk_cat(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor) -> None:
    """`torch._chunk_cat(tensors, 0, num_chunks, out=out)` where `takes` says so (ValueError
    otherwise), on the current stream."""
    if not takes(tensors, num_chunks, out):
        raise ValueError(f"chunk_cat takes contiguous float tensors of one dtype whose dim 0 divides by num_chunks (1 to {MAX_CHUNKS}), "
                         "into a contiguous out of an equal or wider float dtype and their total size, on the current device")
    launch_checked(tensors, num_chunks, out)


def tiles_a_row(tensors: list[torch.Tensor], num_chunks: int) -> int:
    """Programs a row of the output takes: the length of each row of launch_checked's partial sums."""
    return sum(triton.cdiv(t.numel() // num_chunks, BLOCK) for t in tensors)


def launch_checked(tensors: list[torch.Tensor], num_chunks: int, out: torch.Tensor, squares: bool = False) -> torch.Tensor | None:
    """`chunk_cat` for a call `takes` has already accepted (FSDP2's route checks once, then launches).
    `squares`: also the sums of the squares of the elements written, one a program, (num_chunks,
    tiles_a_row) fp32 in the output's order (their sum: the output's squared L2 norm); else None."""
    rows = out.view(num_chunks, -1)
    row_stride = rows.shape[1]
    col = 0
    s_row = tiles_a_row(tensors, num_chunks) if squares else 0
    partials = torch.empty((num_chunks, s_row), dtype=torch.float32, device=out.device) if squares else None
    s = partials if squares else rows  # an unread pointer where no sums are asked for
    base = 0
    for first in range(0, len(tensors), SLOTS):
        group = tensors[first:first + SLOTS]
        xs, cs, cols, ends = [], [], [], []
        tiles = 0
        for t in group:
            c = t.numel() // num_chunks
            xs.append(t)
            cs.append(c)
            cols.append(col)
            col += c
            tiles += triton.cdiv(c, BLOCK)
            ends.append(tiles)
        if tiles:
            pad = SLOTS - len(group)
            _launch((tiles, num_chunks), rows, row_stride, *xs, *[rows] * pad, *cs, *[0] * pad, *cols, *[0] * pad,
                    *ends, *[tiles] * pad, s, s_row, base, NT=len(group), BLOCK=BLOCK, SQUARES=squares, num_warps=NUM_WARPS)
        base += tiles
    return partials
