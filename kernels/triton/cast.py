"""A flat bf16/fp16 tensor upcast to fp32 in one vectorised pass.

torch's `.to(torch.float32)` of a bf16 CUDA tensor (torch 2.11) runs TensorIterator's dynamically
casting copy, one element a load, at about half the speed of the other direction (fp32 -> bf16, a
vectorised kernel of its own), which this kernel matches (pytorch/pytorch#195542 vectorises the
upcast upstream). FSDP2
upcasts each unit's reduced gradients from reduce_dtype to fp32 this way once a step: every
parameter's gradient read and written, on one GPU (src/speed/grad_upcast.py routes it here).

BLOCK elements a program with 4 warps: 16 elements a thread, two 16-byte loads of bf16 each; a
little faster at every size than wider blocks at 8 warps.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from perflab_kernels.triton.launch import Launcher

BLOCK, NUM_WARPS = 2048, 4
UPCAST_DTYPES = (torch.bfloat16, torch.float16)


@triton.jit
def _upcast_fp32(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=mask).to(tl.float32), mask=mask)


_launch = Launcher(_upcast_fp32)  # kernels/triton/launch.py: cached launches


def upcast_fp32(x: torch.Tensor) -> torch.Tensor:
    """`x.to(torch.float32)` for a contiguous bf16/fp16 `x`, bit for bit (every bf16 and fp16 value
    is exact in fp32), into a new tensor; launched, as `.to()` is, on the current device's current
    stream (FSDP2 calls it with that device current)."""
    if x.dtype not in UPCAST_DTYPES or not x.is_contiguous():
        raise ValueError(f"upcast_fp32 takes a contiguous bf16/fp16 tensor, got {x.dtype}{'' if x.is_contiguous() else ' (not contiguous)'}")
    y = torch.empty(x.shape, dtype=torch.float32, device=x.device)
    n = x.numel()
    if n:
        _launch((triton.cdiv(n, BLOCK),), x, y, n, BLOCK=BLOCK, num_warps=NUM_WARPS)
    return y
