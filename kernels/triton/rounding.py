"""Roundings the kernels share, written in integer arithmetic so a GPU and Triton's interpreter give
the same bits: the interpreter's own fp32 -> bf16 cast truncates where a GPU's rounds to nearest
even. Kernels import these by name (kernels/triton/pdl.py says why)."""
from __future__ import annotations

import os

import triton
import triton.language as tl

# Whether this process runs Triton's interpreter (decided at import, as triton.jit decides it). A
# rounding that a GPU's conversion does by itself, to nearest even, is done by the bits only there:
# on an H200 the integer rounding before each e4m3 conversion is ~8 instructions an element, and the
# casts that read e4m3 (1 byte an element) have little else to hide it behind.
INTERPRETED = tl.constexpr(os.environ.get("TRITON_INTERPRET") == "1")


@triton.jit
def bf16_rne(x):
    """fp32 -> bf16, rounded to nearest even, as torch's .to(torch.bfloat16) does for every non-NaN
    value: on a GPU by the conversion itself, under the interpreter by the bits (a NaN stays a NaN:
    0x7FC0 there, the GPU's own NaN on a GPU)."""
    if INTERPRETED:
        bits = x.to(tl.uint32, bitcast=True)
        rounded = (bits + 0x7FFF + ((bits >> 16) & 1)) >> 16
        rounded = tl.where(x != x, 0x7FC0, rounded)
        return rounded.to(tl.uint16).to(tl.bfloat16, bitcast=True)
    return x.to(tl.bfloat16)
