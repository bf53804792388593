"""AdamW over many fp32 tensors in one launch, with the gradients' sum of squares taken on the way.

torch's fused AdamW (`_fused_adamw_`) updates mini_llm's 735M fp32 parameters on an H200 in 6.07 ms
inside the step (3.39 TB/s at 28 bytes a parameter: read parameter, gradient and both moments, write
three; docs/PERFORMANCE.md 5c), in 37 multi_tensor_apply launches. A step that logs its gradient
norm then reads every gradient again for it: `get_total_norm`, 2.9 GB more and about 1.1 ms a step
on one GPU. Here one launch walks every tensor's tiles (a tile table built once for the parameter
shapes; the tensors' addresses in a table per step, since FSDP2 hands out new gradient buffers),
and each program writes its tile's sum of squared gradients, so the norm costs a reduction of one
float per tile instead of a second pass over the gradients.

The update is torch's AdamW (decoupled weight decay, bias corrections from the step count, no
amsgrad), in fp32, in the order torch's fused kernel computes it; results agree with it to fp32
rounding (tests/test_kernel_adamw.py), not bit for bit.
"""
from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

# 2048 elements a program at 4 warps: 16 fp32 elements a thread per stream, seven streams (four read,
# three written), as the gradient upcast (kernels/triton/cast.py) reaches 3.8 TB/s with.
BLOCK, NUM_WARPS = 2048, 4
GRAD_DTYPES = {torch.float32: False, torch.bfloat16: True}


@triton.jit
def _adamw_tiles(PTRS, NUMELS, TILE_TENSOR, TILE_START, SQUARES, n_tensors, wd_scale, beta1, beta2, step_size, inv_bc2_sqrt, eps,
                 BLOCK: tl.constexpr, GRAD_BF16: tl.constexpr, WANT_SQUARES: tl.constexpr):
    """One tile of one tensor a program. PTRS holds four rows of n_tensors addresses: parameters,
    gradients, first moments, second moments."""
    tile = tl.program_id(0)
    t = tl.load(TILE_TENSOR + tile)
    offs = tl.load(TILE_START + tile) + tl.arange(0, BLOCK)
    mask = offs < tl.load(NUMELS + t)
    p_ptr = tl.load(PTRS + t).to(tl.pointer_type(tl.float32))
    if GRAD_BF16:
        g_ptr = tl.load(PTRS + n_tensors + t).to(tl.pointer_type(tl.bfloat16))
    else:
        g_ptr = tl.load(PTRS + n_tensors + t).to(tl.pointer_type(tl.float32))
    m_ptr = tl.load(PTRS + 2 * n_tensors + t).to(tl.pointer_type(tl.float32))
    v_ptr = tl.load(PTRS + 3 * n_tensors + t).to(tl.pointer_type(tl.float32))
    g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    p = tl.load(p_ptr + offs, mask=mask)
    m = tl.load(m_ptr + offs, mask=mask)
    v = tl.load(v_ptr + offs, mask=mask)
    p = p * wd_scale  # decoupled weight decay: p - lr * wd * p
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    p = p - step_size * m / (tl.sqrt(v) * inv_bc2_sqrt + eps)
    tl.store(p_ptr + offs, p, mask=mask)
    tl.store(m_ptr + offs, m, mask=mask)
    tl.store(v_ptr + offs, v, mask=mask)
    if WANT_SQUARES:
        tl.store(SQUARES + tile, tl.sum(g * g, axis=0))


class TileTable:
    """Which tensor and which offset each program takes, for one list of tensor sizes: built once
    (735M elements are 359k tiles of 2048, 4.3 MB of table) and reused while the sizes stay."""

    def __init__(self, numels: list[int], device: torch.device):
        self.numels_list = list(numels)
        tiles = [math.ceil(n / BLOCK) for n in numels]
        self.n_tiles = sum(tiles)
        self.numels = torch.tensor(numels, dtype=torch.int64, device=device)
        index = torch.repeat_interleave(torch.arange(len(numels)), torch.tensor(tiles))
        first = torch.cumsum(torch.tensor([0, *tiles[:-1]]), 0)
        start = (torch.arange(self.n_tiles) - first[index]) * BLOCK
        self.tensor = index.to(torch.int32).to(device)
        self.start = start.to(torch.int64).to(device)


def adamw_step_(params: list[torch.Tensor], grads: list[torch.Tensor], exp_avgs: list[torch.Tensor], exp_avg_sqs: list[torch.Tensor],
                table: TileTable, *, step: int, lr: float, beta1: float, beta2: float, eps: float, weight_decay: float,
                want_squares: bool = False) -> torch.Tensor | None:
    """AdamW's update of every tensor in place (fp32 parameters and moments, contiguous; gradients
    fp32 or bf16, contiguous, all of one dtype), the bias corrections of step `step` (counted from 1).
    Returns the sum of the gradients' squares (an fp32 device scalar) when `want_squares`."""
    if not params:
        return torch.zeros((), dtype=torch.float32) if want_squares else None
    device = params[0].device
    grad_bf16 = GRAD_DTYPES[grads[0].dtype]
    # one pinned table of addresses a step, copied behind the stream's work: no host sync
    ptrs = torch.tensor([t.data_ptr() for group in (params, grads, exp_avgs, exp_avg_sqs) for t in group], dtype=torch.int64,
                        pin_memory=device.type == "cuda").to(device, non_blocking=True)
    squares = torch.empty(table.n_tiles, dtype=torch.float32, device=device) if want_squares else ptrs
    bc1, bc2 = 1.0 - beta1**step, 1.0 - beta2**step
    _adamw_tiles[(table.n_tiles,)](
        ptrs, table.numels, table.tensor, table.start, squares, len(params), 1.0 - lr * weight_decay, beta1, beta2, lr / bc1,
        1.0 / math.sqrt(bc2), eps, BLOCK=BLOCK, GRAD_BF16=grad_bf16, WANT_SQUARES=want_squares, num_warps=NUM_WARPS,
    )
    return squares.sum() if want_squares else None
