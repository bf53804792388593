"""The fp32 upcast of FSDP2's reduced gradients (kernels/triton/cast.py, src/speed/grad_upcast.py):
bit for bit what torch's .to() gives, at odd sizes, in Triton's interpreter on a CPU; the routing of
FSDP2's cast, and what is left to torch."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from perflab_kernels.triton.cast import upcast_fp32  # noqa: E402
from src.speed import grad_upcast  # noqa: E402
from tests.support.devices import needs_gpu  # noqa: E402
from tests.support.ranks import spawn_ranks  # noqa: E402

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
        assert grad_upcast.install() and grad_upcast.install()  # twice: installed once
        assert _fsdp_collectives._to_dtype_if_needed is grad_upcast._to_dtype_if_needed
        assert grad_upcast.PATCH.fsdp2 == {"_to_dtype_if_needed": original}
        # what the kernel does not take goes to FSDP2's own: host tensors, the downcast, no cast at all
        x = torch.randn(9).to(torch.bfloat16)
        assert torch.equal(_fsdp_collectives._to_dtype_if_needed(x, torch.float32), x.float())
        y = torch.randn(9)
        assert _fsdp_collectives._to_dtype_if_needed(y, None) is y and _fsdp_collectives._to_dtype_if_needed(y, torch.float32) is y
    finally:
        grad_upcast.restore()
    assert _fsdp_collectives._to_dtype_if_needed is original and not grad_upcast.PATCH.installed()
    grad_upcast.restore()  # nothing installed: nothing to do
    assert _fsdp_collectives._to_dtype_if_needed is original


def test_another_wrapper_installed_after_ours_is_left_alone():
    """Code that wraps FSDP2's cast after this module did keeps its wrapper: restoring does not
    drop it, and installing again does not take it for the original (which would recurse)."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._to_dtype_if_needed
    try:
        assert grad_upcast.install()
        ours = _fsdp_collectives._to_dtype_if_needed

        def theirs(tensor, dtype):
            return ours(tensor, dtype)

        _fsdp_collectives._to_dtype_if_needed = theirs
        grad_upcast.restore()
        assert _fsdp_collectives._to_dtype_if_needed is theirs and grad_upcast.PATCH.fsdp2 == {"_to_dtype_if_needed": original}
        assert not grad_upcast.install() and grad_upcast.PATCH.fsdp2 == {"_to_dtype_if_needed": original}
        x = torch.randn(4).to(torch.bfloat16)
        assert torch.equal(theirs(x, torch.float32), x.float())  # through ours to the original, no loop
    finally:
        _fsdp_collectives._to_dtype_if_needed = grad_upcast._to_dtype_if_needed
        grad_upcast.restore()
    assert _fsdp_collectives._to_dtype_if_needed is original


def test_fsdp2_gradients_upcast_by_triton_equal_torchs_on_gloo(tmp_path):
    """The recipe's parity test: 2 gloo ranks, a bf16 reduce under fp32 parameters, FSDP2's own path
    against the recipe's (its Triton kernel in the interpreter): the sharded fp32 gradients are the
    same bits, and the kernel ran once a unit."""
    from tests.support.fsdp_one_rank import gloo_grads_per_route

    out = tmp_path / "out.pt"
    spawn_ranks(gloo_grads_per_route, (str(tmp_path / "init"), str(out), 2, torch.bfloat16, grad_upcast.install, grad_upcast.restore,
                                       "perflab_kernels.triton.cast", "upcast_fp32"), 2)
    got = torch.load(out)
    ours, torchs = got["grads"]["recipe"], got["grads"]["torch"]
    assert all(g.dtype == torch.float32 for g in ours) and len(ours) == 4
    assert all(torch.equal(a, b) for a, b in zip(ours, torchs))
    assert got["calls"] == 2  # the two linears' units; the root holds no parameters


@pytest.mark.parametrize("use, device, reduce_dtype, runs", [
    ("auto", "cuda", "bfloat16", True), ("auto", "cuda", "float16", True), ("on", "cuda", "bfloat16", True),
    ("off", "cuda", "bfloat16", False),    # torch's own, as asked
    ("auto", "cpu", "bfloat16", False),    # measured on GPUs: a CPU run keeps torch's path unless asked
    ("on", "cpu", "bfloat16", True),       # asked for: its kernel in Triton's interpreter
    ("auto", "cuda", "float32", False),    # an fp32 reduce has no upcast
])
def test_speed_grad_upcast_decides_the_route(use, device, reduce_dtype, runs):
    """src/speed/apply.py's verdict, and install_fsdp putting the function in place (or torch's back):
    no GPU needed, the model is not touched by this recipe."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from src.config.compose import compose_config
    from src.speed.apply import decide, install_fsdp

    original = _fsdp_collectives._to_dtype_if_needed
    cfg = compose_config([f"speed.grad_upcast={use}"])
    verdicts = decide(cfg, 2, device, reduce_dtype)
    assert verdicts["grad_upcast"].on is runs and verdicts["grad_upcast"].warning is None
    try:
        grad_upcast.install()  # a run before this one in the same process left it routed
        only = {name: v if name == "grad_upcast" else type(v)(False) for name, v in verdicts.items()}
        assert install_fsdp(torch.nn.Linear(2, 2), only, "bfloat16", main=False) == (["grad_upcast"] if runs else [])
        assert (_fsdp_collectives._to_dtype_if_needed is grad_upcast._to_dtype_if_needed) is runs
    finally:
        grad_upcast.restore()
    assert _fsdp_collectives._to_dtype_if_needed is original


@pytest.mark.gpu
@needs_gpu
def test_fsdp2_gradients_upcast_by_triton_equal_torchs(monkeypatch):
    """One NCCL rank, a bf16 reduce under fp32 parameters: the sharded fp32 gradients after one
    backward are the same bits with either upcast, and the Triton kernel ran once a unit."""
    import perflab_kernels.triton.cast as cast
    from tests.support.fsdp_one_rank import sharded_grads_per_route

    calls = []

    def route(choice: str) -> None:
        if choice == "triton":
            assert grad_upcast.install()
            monkeypatch.setattr(cast, "upcast_fp32", lambda t, kernel=cast.upcast_fp32: calls.append(t.numel()) or kernel(t))
        else:
            grad_upcast.restore()

    try:
        grads = sharded_grads_per_route(torch.bfloat16, route)
    finally:
        grad_upcast.restore()
    assert all(g.dtype == torch.float32 for g in grads["triton"])
    assert all(torch.equal(a, b) for a, b in zip(grads["triton"], grads["torch"]))
    assert len(calls) == 2  # the two linears' units; the root holds no parameters
