"""Fused SwiGLU (silu(g) * u) and softmax against torch, forward and backward, odd shapes."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from perflab_kernels.triton.softmax import FusedSoftmax, fused_softmax  # noqa: E402
from perflab_kernels.triton.swiglu import FusedSiLUMul, fused_swiglu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# Elementwise in fp32 inside the kernel, rounded once on store: within a couple of bf16 ulps of
# torch's (which rounds silu(g) to bf16 before the product: one more rounding than ours).
TOLERANCE = {torch.float32: (1e-6, 1e-5), torch.bfloat16: (1e-2, 1.6e-2)}
DTYPES = pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
SHAPES = pytest.mark.parametrize("shape", [(5, 123), (3, 7, 257), (1, 4097), (2, 3000)], ids=lambda s: "x".join(map(str, s)))


def _grads(fn, inputs, dy):
    leaves = [t.clone().requires_grad_() for t in inputs]
    out = fn(*leaves)
    out.backward(dy)
    return out, [t.grad for t in leaves]


@DTYPES
@SHAPES
def test_swiglu_matches_torch(shape, dtype):
    torch.manual_seed(0)
    atol, rtol = TOLERANCE[dtype]
    g, u, dy = (torch.randn(shape, device=DEVICE, dtype=dtype) * 3 for _ in range(3))
    out, grads = _grads(fused_swiglu, (g, u), dy)
    ref, ref_grads = _grads(lambda a, b: (F.silu(a.float()) * b.float()).to(dtype), (g, u), dy)
    torch.testing.assert_close(out, ref, atol=atol, rtol=rtol)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, atol=atol, rtol=rtol)


def test_swiglu_takes_strided_halves_of_one_projection():
    gu = torch.randn(4, 6, 2 * 33, device=DEVICE)
    g, u = gu.chunk(2, dim=-1)  # non-contiguous views, as a fused gate-up projection gives
    torch.testing.assert_close(FusedSiLUMul()(g, u), F.silu(g) * u)
    with pytest.raises(ValueError, match="one shape"):
        fused_swiglu(g, u[..., :5])


@DTYPES
@SHAPES
def test_softmax_matches_torch(shape, dtype):
    torch.manual_seed(0)
    atol, rtol = TOLERANCE[dtype]
    x, dy = (torch.randn(shape, device=DEVICE, dtype=dtype) * 4 for _ in range(2))
    out, (dx,) = _grads(fused_softmax, (x,), dy)
    ref, (ref_dx,) = _grads(lambda t: torch.softmax(t.float(), -1), (x,), dy.float())
    torch.testing.assert_close(out, ref.to(dtype), atol=atol, rtol=rtol)
    # dx = y * (dy - sum(y * dy)) cancels where y is near 1; from a bf16 y (ours and torch's own
    # bf16 softmax alike) that leaves errors near 1% of the largest gradient, not of each element.
    dx_atol = atol if dtype == torch.float32 else 0.02 * ref_dx.abs().max().item()
    torch.testing.assert_close(dx.float(), ref_dx.float(), atol=dx_atol, rtol=rtol)
    torch.testing.assert_close(out.float().sum(-1), torch.ones(shape[:-1], device=DEVICE), atol=atol * 4, rtol=0)


@pytest.mark.parametrize("programs_stages", [(1, 2), (2, 3)], ids=["1-per-sm", "2-per-sm"])
def test_softmax_looped_programs_match_torch(programs_stages, monkeypatch):
    """Programs that each walk several rows (PROGRAMS_PER_SM > 0, pipelined): 2 or 4 programs on a
    CPU over 11 rows, so rows split unevenly, give torch's forward and backward."""
    import perflab_kernels.triton.softmax as sm

    monkeypatch.setattr(sm, "PROGRAMS_PER_SM", programs_stages[0])
    monkeypatch.setattr(sm, "STAGES", programs_stages[1])
    torch.manual_seed(3)
    x, dy = (torch.randn(11, 133, device=DEVICE) * 4 for _ in range(2))
    out, (dx,) = _grads(fused_softmax, (x,), dy)
    ref, (ref_dx,) = _grads(lambda t: torch.softmax(t, -1), (x,), dy)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(dx, ref_dx, atol=1e-5, rtol=1e-5)


def test_softmax_module_and_row_limit():
    x = torch.randn(3, 10, device=DEVICE)
    torch.testing.assert_close(FusedSoftmax()(x), torch.nn.Softmax(dim=-1)(x))
    with pytest.raises(ValueError, match="rows of 70000 > 65536"):
        fused_softmax(torch.randn(2, 70000, device=DEVICE))
