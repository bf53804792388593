"""Roundings the kernels share. On a GPU the conversion itself rounds to nearest even; Triton's
interpreter's does not (its fp32 -> bf16 cast truncates), so there they round in integer arithmetic
first, and a GPU and the interpreter give the same bits. Kernels import these by name
(kernels/triton/pdl.py says why)."""
from __future__ import annotations

import triton
import triton.language as tl
from perflab_kernels.triton.device import interpreted

# Whether this process runs Triton's interpreter (read at import, as triton.jit reads it). A rounding
# that a GPU's conversion does by itself, to nearest even, is done by the bits only there: on a GPU
# the integer rounding before each e4m3 conversion (about 8 instructions an element) held the float8
# casts well below the copy ceiling (benchmarks/fp8_casts.py times them).
INTERPRETED = tl.constexpr(interpreted())


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
