"""FSDP2's reduce-scatter copy-in (kernels/triton/chunk_cat.py, src/speed/reduce_copy_in.py):
bit for bit torch._chunk_cat, in Triton's interpreter on a CPU, at odd sizes and world sizes; what the
kernel refuses; the routing of FSDP2's function and what is left to torch."""
from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")

from perflab_kernels.triton.chunk_cat import SLOTS, chunk_cat, takes  # noqa: E402
from src.speed import reduce_copy_in  # noqa: E402
from tests.support.devices import needs_gpu  # noqa: E402
from tests.support.ranks import spawn_ranks  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _grads(world: int, dtype: torch.dtype, count: int = 5) -> list[torch.Tensor]:
    # dim 0 a multiple of the world size, the rest odd; a 1-D gradient (a norm's weight) among them
    shapes = [(world * 3, 7), (world * 1,), (world * 5, 3, 2), (world * 2, 11), (world * 7,), (world * 4, 9), (world, 1)]
    g = torch.Generator().manual_seed(world)
    return [(torch.randn(shapes[i % len(shapes)], generator=g) * 100).to(dtype).to(DEVICE) for i in range(count)]


@pytest.mark.parametrize("world", [1, 2, 3, 4])
@pytest.mark.parametrize("src, dst", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                      (torch.bfloat16, torch.bfloat16), (torch.float32, torch.float32)],
                         ids=["bf16-fp32", "fp16-fp32", "bf16-bf16", "fp32-fp32"])
def test_chunk_cat_is_torchs_bit_for_bit(world, src, dst):
    grads = _grads(world, src)
    # the values a cast can get wrong: signed zero, infinities, NaN (and a subnormal where the device
    # keeps it: Triton's interpreter flushes bf16 subnormals in its numpy emulation)
    tiny = 1e-40 if src == torch.bfloat16 and DEVICE == "cuda" else 1e-7 if src == torch.float16 else 1e-30 if src != torch.bfloat16 else 0.0
    grads[0].view(-1)[:5] = torch.tensor([-0.0, float("inf"), float("-inf"), float("nan"), tiny]).to(src)
    n = sum(t.numel() for t in grads)
    out, ref = torch.empty(n, dtype=dst, device=DEVICE), torch.empty(world, n // world, dtype=dst, device=DEVICE)
    torch._chunk_cat(grads, 0, world, out=ref)
    assert takes(grads, world, out)
    chunk_cat(grads, world, out)
    assert torch.equal(out.view(world, -1).view(torch.uint8), ref.view(torch.uint8))


def test_more_gradients_than_one_launch_holds():
    world = 2
    grads = _grads(world, torch.bfloat16, count=2 * SLOTS + 3)
    n = sum(t.numel() for t in grads)
    out, ref = torch.empty(n, device=DEVICE), torch.empty(world, n // world, device=DEVICE)
    torch._chunk_cat(grads, 0, world, out=ref)
    chunk_cat(grads, world, out)
    assert torch.equal(out.view(world, -1), ref)


@pytest.mark.parametrize("world, count", [(1, 5), (3, 2 * SLOTS + 3)], ids=["1rank-5", "3ranks-19"])
def test_the_copy_with_squares_writes_the_same_bits_and_each_programs_sum_of_squares(world, count):
    """speed.norm_in_copy_in's launch: the copy as without it, and per row one sum of squares per
    program in the output's order (19 gradients: three launches, each writing after the last's)."""
    from perflab_kernels.triton.chunk_cat import BLOCK, launch_checked, tiles_a_row

    grads = _grads(world, torch.bfloat16, count=count)
    n = sum(t.numel() for t in grads)
    out, ref = torch.empty(n, device=DEVICE), torch.empty(n, device=DEVICE)
    chunk_cat(grads, world, ref)
    partials = launch_checked(grads, world, out, squares=True)
    assert torch.equal(out, ref) and launch_checked(grads, world, torch.empty_like(out)) is None
    assert partials.shape == (world, tiles_a_row(grads, world)) and partials.dtype == torch.float32
    want = []  # each gradient's chunk r in BLOCK-element tiles, as the programs take them
    for r in range(world):
        row = []
        for t in grads:
            chunk = t.reshape(world, -1)[r].double()
            row += [chunk[i:i + BLOCK].square().sum() for i in range(0, chunk.numel(), BLOCK)]
        want.append(torch.stack(row))
    assert torch.allclose(partials.double(), torch.stack(want), rtol=1e-6, atol=0)
    assert partials.double().sum().item() == pytest.approx(out.double().square().sum().item(), rel=1e-6)


def test_what_the_kernel_refuses():
    grads = _grads(2, torch.bfloat16)
    n = sum(t.numel() for t in grads)
    out = torch.empty(n, device=DEVICE)
    assert not takes(grads, 3, out)  # a dim 0 that does not divide: torch pads the chunks
    assert not takes(grads, 2, torch.empty(n, dtype=torch.float16, device=DEVICE))  # bf16 -> fp16 rounds
    assert not takes([g.float() for g in grads], 2, torch.empty(n, dtype=torch.bfloat16, device=DEVICE))  # a downcast
    assert takes([g.float() for g in grads], 2, out)  # fp32 gradients alone would do
    assert not takes([grads[0].float()] + grads[1:], 2, out)  # but not two source dtypes in one call
    square = torch.randn(6, 6).to(torch.bfloat16).to(DEVICE)
    assert takes([square], 2, torch.empty(36, device=DEVICE)) and not takes([square.t()], 2, torch.empty(36, device=DEVICE))  # not contiguous
    assert not takes(grads, 65536, out)  # more rows than the grid's second axis holds (65535)
    assert not takes(grads, 2, torch.empty(n + 2, device=DEVICE))  # the wrong size
    assert not takes(grads, 2, torch.empty(2, n, device=DEVICE)[:, ::2])  # out not contiguous
    assert not takes(grads + [torch.empty(0, 3, dtype=torch.bfloat16, device=DEVICE)], 2, out)  # empty: torch raises
    with pytest.raises(ValueError, match="divides by num_chunks"):
        chunk_cat(grads, 3, out)


def test_fsdp2s_copy_in_is_routed_and_restored():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives.foreach_reduce_scatter_copy_in
    try:
        assert reduce_copy_in.install() and reduce_copy_in.install()
        assert _fsdp_collectives.foreach_reduce_scatter_copy_in is reduce_copy_in.foreach_reduce_scatter_copy_in
        # host tensors (and anything the kernel refuses) go to FSDP2's own, with its signature
        grads = [torch.randn(4, 3).to(torch.bfloat16), torch.randn(2).to(torch.bfloat16)]
        out, ref = torch.empty(14), torch.empty(2, 7)
        _fsdp_collectives.foreach_reduce_scatter_copy_in(grads, out, 2)
        original(grads, ref, 2)
        assert torch.equal(out.view(2, 7), ref)
    finally:
        reduce_copy_in.restore()
    assert _fsdp_collectives.foreach_reduce_scatter_copy_in is original and not reduce_copy_in.PATCH.installed()


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp2_gradients_copied_by_triton_equal_torchs_on_gloo(tmp_path, reduce_dtype):
    """The recipe's parity test: 2 gloo ranks, bf16 compute, FSDP2's own copy-in against the recipe's
    (its Triton kernel in the interpreter, chunking each gradient for the two ranks): the sharded
    gradients are the same bits, and the kernel ran once a unit."""
    from tests.support.fsdp_one_rank import gloo_grads_per_route

    out = tmp_path / "out.pt"
    spawn_ranks(gloo_grads_per_route, (str(tmp_path / "init"), str(out), 2, reduce_dtype, reduce_copy_in.install, reduce_copy_in.restore,
                                       "perflab_kernels.triton.chunk_cat", "launch_checked"), 2)
    got = torch.load(out)
    assert all(torch.equal(a, b) for a, b in zip(got["grads"]["recipe"], got["grads"]["torch"]))
    assert len(got["grads"]["recipe"]) == 4 and got["calls"] == 2  # each linear's unit: weight and bias


@pytest.mark.parametrize("use, device, routed", [("auto", "cuda", True), ("off", "cuda", False), ("auto", "cpu", False), ("on", "cpu", True)])
def test_speed_reduce_copy_in_decides_the_route(use, device, routed):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    from src.config.compose import compose_config
    from src.speed.apply import decide, install_fsdp

    verdicts = decide(compose_config([f"speed.reduce_copy_in={use}"]), 2, device, "float32")
    only = {name: v if name == "reduce_copy_in" else type(v)(False) for name, v in verdicts.items()}
    try:
        reduce_copy_in.install()  # a run before this one in the same process left it routed
        install_fsdp(torch.nn.Linear(2, 2), only, "bfloat16", main=False)
        assert (_fsdp_collectives.foreach_reduce_scatter_copy_in is reduce_copy_in.foreach_reduce_scatter_copy_in) == routed
    finally:
        reduce_copy_in.restore()


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fsdp2_gradients_copied_by_triton_equal_torchs(monkeypatch, reduce_dtype):
    """One NCCL rank, bf16 compute: the sharded fp32 gradients after one backward are the same bits
    with either copy-in, and the Triton kernel ran once a unit."""
    import perflab_kernels.triton.chunk_cat as kernel
    from tests.support.fsdp_one_rank import sharded_grads_per_route

    calls = []

    def route(choice: str) -> None:
        if choice == "triton":
            assert reduce_copy_in.install()
            monkeypatch.setattr(kernel, "launch_checked", lambda ts, w, out, f=kernel.launch_checked: calls.append(len(ts)) or f(ts, w, out))
        else:
            reduce_copy_in.restore()

    try:
        grads = sharded_grads_per_route(reduce_dtype, route)
    finally:
        reduce_copy_in.restore()
    assert all(torch.equal(a, b) for a, b in zip(grads["triton"], grads["torch"]))
    assert calls == [2, 2]  # each linear's unit: weight and bias; the root holds no parameters
