"""speed.reduce_copy_in: FSDP2's reduce-scatter copy-in through kernels/triton/chunk_cat.py.

After each unit's backward FSDP2 copies its unsharded gradients into the reduce-scatter input
(`foreach_reduce_scatter_copy_in`: `torch._chunk_cat` into reduce_dtype) on the compute stream, so
the copy is on the step's critical path, and on torch 2.11 it runs well under the copy ceiling when
it upcasts. The module global FSDP2 looks up at each reduce is replaced by one that sends the calls
the Triton kernel does bit for bit (contiguous gradients of one float dtype on a device the kernel
runs on, whose dim 0 divides by the world size, into an equal or wider reduce dtype) to it, and
every other call (torch 2.15's mixed-dtype groups among them) to FSDP2's own.
"""
from __future__ import annotations

import torch

from src.speed.grad_squares import SQUARES
from src.speed.patch import Patch
from src.speed.recipe import FSDP, Recipe
from src.speed.versions import TRITON_TESTED

_KERNEL = None  # perflab_kernels.triton.chunk_cat, imported when installed (Triton may be missing)
_RUNS_ON = None  # perflab_kernels.triton.device.kernels_run_on


def foreach_reduce_scatter_copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
    if _RUNS_ON(reduce_scatter_input) and not torch.compiler.is_compiling() and _KERNEL.takes(unsharded_grads, world_size, reduce_scatter_input):
        if SQUARES.on and world_size == 1:  # speed.norm_in_copy_in: the squares summed as written (src/speed/grad_squares.py)
            # FSDP2 then copies the one-rank input onto the reduce output (`reduce_output.copy_(reduce_scatter_input)`),
            # which speed.one_rank_copies makes the same tensor: the same values, one more version (torch 2.11-2.15)
            partials = _KERNEL.launch_checked(unsharded_grads, world_size, reduce_scatter_input, squares=True)
            SQUARES.record(reduce_scatter_input, partials, later_writes=1)
        else:
            _KERNEL.launch_checked(unsharded_grads, world_size, reduce_scatter_input)
    else:
        PATCH.fsdp2["foreach_reduce_scatter_copy_in"](unsharded_grads, reduce_scatter_input, world_size)


PATCH = Patch({"foreach_reduce_scatter_copy_in": foreach_reduce_scatter_copy_in})
COLLECTIVES = f"{FSDP}._fsdp_collectives:"


def install() -> bool:
    """Route FSDP2's reduce-scatter copy-in through the Triton kernel; False (and nothing changed)
    where this torch's FSDP2 has no `foreach_reduce_scatter_copy_in`, Triton is missing, or other
    code has replaced the function since an earlier install."""
    global _KERNEL, _RUNS_ON
    try:
        import perflab_kernels.triton.chunk_cat as chunk_cat
        from perflab_kernels.triton.device import kernels_run_on
    except ImportError:
        return False
    _KERNEL, _RUNS_ON = chunk_cat, kernels_run_on
    return PATCH.install()


def restore() -> None:
    """FSDP2's own copy-in again, unless something else has replaced the function since."""
    PATCH.restore()


RECIPE = Recipe(
    name="reduce_copy_in",
    does="copies FSDP2's unsharded gradients into the reduce-scatter input with a vectorised Triton kernel",
    replaces=(COLLECTIVES + "foreach_reduce_scatter_copy_in",),
    reads=(),
    signatures={COLLECTIVES + "foreach_reduce_scatter_copy_in": ("unsharded_grads", "reduce_scatter_input", "world_size")},
    gain="1.0-1.5 ms a step of +exp=fsdp4: docs/RESULTS.md, Speed recipes",
    parity="tests/integration/test_reduce_copy_in.py::test_fsdp2_gradients_copied_by_triton_equal_torchs_on_gloo",
    restore=restore,
    originals=lambda: PATCH.originals(COLLECTIVES),
    triton=TRITON_TESTED,
)
