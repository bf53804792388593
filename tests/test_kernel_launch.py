"""kernels/triton/launch.py: what its cache keys on, and that the plain launch is kept where there
is no compiled kernel (Triton's interpreter). The cached launch itself is checked on a GPU
(tests/test_gpu.py: bit for bit against plain launches, over shapes and alignments that change
Triton's specialisation)."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402

from kernels.triton.launch import Launcher, arg_key  # noqa: E402


@triton.jit
def _scale(X, Y, n, factor, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, tl.load(X + offs, mask=offs < n) * factor, mask=offs < n)


def test_the_key_tells_apart_what_triton_specialises_on():
    base = torch.zeros(64, dtype=torch.bfloat16)
    assert arg_key(base) == (torch.bfloat16, True)
    assert arg_key(base[1:]) == (torch.bfloat16, False)  # 2 bytes past a 16-byte boundary
    assert arg_key(base[8:]) == (torch.bfloat16, True)   # 16 bytes past it
    assert arg_key(base.float()) != arg_key(base)
    # integers by value: 8192 and 8191 differ in divisibility by 16, 1 is specialised on its own
    assert len({arg_key(v) for v in (1, 16, 8191, 8192)}) == 4
    # floats are not specialised: one key whatever the value
    assert arg_key(1e-6) == arg_key(1e-5)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the interpreter's path: kernels run compiled on a GPU")
def test_the_interpreter_launches_the_plain_way_and_keeps_nothing():
    launch = Launcher(_scale)
    x = torch.arange(37, dtype=torch.float32)
    for n in (37, 20):
        y = torch.zeros_like(x)
        launch((triton.cdiv(n, 16),), x, y, n, 2.5, BLOCK=16)
        assert torch.equal(y[:n], x[:n] * 2.5) and not y[n:].any()
    assert launch.misses == 2 and launch.hits == 0 and not launch.compiled
