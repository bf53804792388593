"""The fp32 upcast of FSDP2's reduced gradients (kernels/triton/cast.py, src/distributed/grad_cast.py):
bit for bit what torch's .to() gives, at odd sizes, in Triton's interpreter on a CPU; the routing of
FSDP2's cast, and what is left to torch."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from kernels.triton.cast import upcast_fp32  # noqa: E402
from src.distributed import grad_cast  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("n", [0, 1, 2047, 2049, 12345])
def test_upcast_is_torchs_cast_bit_for_bit(n, dtype):
    torch.manual_seed(0)
    x = torch.randn(n, device=DEVICE).mul_(1e3).to(dtype)
    if n > 4:  # the values a cast can get wrong: signed zero, infinities, NaN, a subnormal
        # (Triton's interpreter flushes bf16 subnormals to zero in its numpy emulation; the GPU's
        # cvt.f32.bf16 keeps them, so the bf16 one is checked there only)
        tiny = 1e-40 if dtype == torch.bfloat16 and DEVICE == "cuda" else 1e-7 if dtype == torch.float16 else 1e-30
        x[:5] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), tiny]).to(dtype)
    y = upcast_fp32(x)
    assert y.dtype == torch.float32 and y.shape == x.shape and y.device == x.device
    assert torch.equal(y.view(torch.int32), x.to(torch.float32).view(torch.int32))  # NaN payloads and -0.0 too


def test_upcast_keeps_the_shape_and_refuses_what_it_does_not_do():
    x = torch.randn(3, 5, 7, device=DEVICE).to(torch.bfloat16)
    assert torch.equal(upcast_fp32(x), x.float())
    with pytest.raises(ValueError, match="not contiguous"):
        upcast_fp32(x.transpose(0, 2))
    with pytest.raises(ValueError, match="got torch.float32"):
        upcast_fp32(x.float())


def test_fsdp2s_cast_is_routed_and_restored():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._to_dtype_if_needed
    try:
        assert grad_cast.use_triton_grad_upcast() and grad_cast.use_triton_grad_upcast()  # twice: installed once
        assert _fsdp_collectives._to_dtype_if_needed is grad_cast._to_dtype_if_needed
        assert grad_cast.PATCH.fsdp2 == {"_to_dtype_if_needed": original}
        # what the kernel does not take goes to FSDP2's own: host tensors, the downcast, no cast at all
        x = torch.randn(9).to(torch.bfloat16)
        assert torch.equal(_fsdp_collectives._to_dtype_if_needed(x, torch.float32), x.float())
        y = torch.randn(9)
        assert _fsdp_collectives._to_dtype_if_needed(y, None) is y and _fsdp_collectives._to_dtype_if_needed(y, torch.float32) is y
    finally:
        grad_cast.restore_grad_upcast()
    assert _fsdp_collectives._to_dtype_if_needed is original and not grad_cast.PATCH.installed()
    grad_cast.restore_grad_upcast()  # nothing installed: nothing to do
    assert _fsdp_collectives._to_dtype_if_needed is original


def test_another_wrapper_installed_after_ours_is_left_alone():
    """Code that wraps FSDP2's cast after this module did keeps its wrapper: restoring does not
    drop it, and installing again does not take it for the original (which would recurse)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._to_dtype_if_needed
    try:
        assert grad_cast.use_triton_grad_upcast()
        ours = _fsdp_collectives._to_dtype_if_needed

        def theirs(tensor, dtype):
            return ours(tensor, dtype)

        _fsdp_collectives._to_dtype_if_needed = theirs
        grad_cast.restore_grad_upcast()
        assert _fsdp_collectives._to_dtype_if_needed is theirs and grad_cast.PATCH.fsdp2 == {"_to_dtype_if_needed": original}
        assert not grad_cast.use_triton_grad_upcast() and grad_cast.PATCH.fsdp2 == {"_to_dtype_if_needed": original}
        x = torch.randn(4).to(torch.bfloat16)
        assert torch.equal(theirs(x, torch.float32), x.float())  # through ours to the original, no loop
    finally:
        _fsdp_collectives._to_dtype_if_needed = grad_cast._to_dtype_if_needed
        grad_cast.restore_grad_upcast()
    assert _fsdp_collectives._to_dtype_if_needed is original


@pytest.mark.parametrize("choice, device, reduce_dtype, routed", [
    ("triton", "cuda", "bfloat16", True), ("triton", "cuda", "float16", True),
    ("torch", "cuda", "bfloat16", False),   # asked for torch's
    ("triton", "cpu", "bfloat16", False),   # gloo ranks: host tensors, nothing to route
    ("triton", "cuda", "float32", False),   # an fp32 reduce has no upcast
])
def test_sharding_grad_upcast_decides_the_route(choice, device, reduce_dtype, routed):
    """parallelize's `_grad_upcast` (it only installs or restores the function: no GPU needed)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from src.distributed.parallelize import _grad_upcast

    original = _fsdp_collectives._to_dtype_if_needed
    try:
        grad_cast.use_triton_grad_upcast()  # a run before this one in the same process left it routed
        _grad_upcast(choice, reduce_dtype, torch.device(device), main=False)
        assert (_fsdp_collectives._to_dtype_if_needed is grad_cast._to_dtype_if_needed) is routed
    finally:
        grad_cast.restore_grad_upcast()
    assert _fsdp_collectives._to_dtype_if_needed is original


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_fsdp2_gradients_upcast_by_triton_equal_torchs(monkeypatch):
    """One NCCL rank, a bf16 reduce under fp32 parameters: the sharded fp32 gradients after one
    backward are the same bits with either upcast, and the Triton kernel ran once a unit."""
    import kernels.triton.cast as cast
    from tests.fsdp_one_rank import sharded_grads_per_route

    calls = []

    def route(choice: str) -> None:
        if choice == "triton":
            assert grad_cast.use_triton_grad_upcast()
            monkeypatch.setattr(cast, "upcast_fp32", lambda t, kernel=cast.upcast_fp32: calls.append(t.numel()) or kernel(t))
        else:
            grad_cast.restore_grad_upcast()

    try:
        grads = sharded_grads_per_route(torch.bfloat16, route)
    finally:
        grad_cast.restore_grad_upcast()
    assert all(g.dtype == torch.float32 for g in grads["triton"])
    assert all(torch.equal(a, b) for a, b in zip(grads["triton"], grads["torch"]))
    assert len(calls) == 2  # the two linears' units; the root holds no parameters
