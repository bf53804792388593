"""FSDP2's reduce-scatter copy-in through kernels/triton/chunk_cat.py (`sharding.reduce_copy_in`).

After each unit's backward FSDP2 copies its unsharded gradients into the reduce-scatter input
(`foreach_reduce_scatter_copy_in`: `torch._chunk_cat` into reduce_dtype) on the compute stream, so
the copy is on the step's critical path. On torch 2.11 that copy runs at 1.7-1.8 TB/s when it
upcasts bf16 gradients to the seed's fp32 reduce and 2.5 TB/s bf16 to bf16, for all of a unit's
unsharded gradients whatever the number of GPUs (735M for mini_llm, every step); a flat vectorised
copy of the same bytes reaches 3.8 (docs/PERFORMANCE.md 7).

The module global FSDP2 looks up at each reduce is replaced by one that sends the calls the Triton
kernel does bit for bit (CUDA, contiguous gradients of one float dtype whose dim 0 divides by the
world size, an equal or wider reduce dtype) to it and every other to FSDP2's own. Process-wide;
where this torch has no such function, or Triton is missing, nothing changes and
`use_triton_reduce_copy_in` says so.
"""
from __future__ import annotations

import torch

from src.distributed.fsdp_patch import CollectivesPatch

_KERNEL = None  # kernels.triton.chunk_cat, imported when installed (Triton may be missing)


def foreach_reduce_scatter_copy_in(unsharded_grads: list[torch.Tensor], reduce_scatter_input: torch.Tensor, world_size: int) -> None:
    if reduce_scatter_input.is_cuda and not torch.compiler.is_compiling() and _KERNEL.takes(unsharded_grads, world_size, reduce_scatter_input):
        _KERNEL.launch_checked(unsharded_grads, world_size, reduce_scatter_input)
    else:
        PATCH.fsdp2["foreach_reduce_scatter_copy_in"](unsharded_grads, reduce_scatter_input, world_size)


PATCH = CollectivesPatch({"foreach_reduce_scatter_copy_in": foreach_reduce_scatter_copy_in})


def use_triton_reduce_copy_in() -> bool:
    """Route FSDP2's reduce-scatter copy-in through the Triton kernel; False (and nothing changed)
    where this torch's FSDP2 has no `foreach_reduce_scatter_copy_in`, Triton is missing, or other
    code has replaced the function since an earlier install."""
    global _KERNEL
    try:
        import kernels.triton.chunk_cat as chunk_cat
    except ImportError:
        return False
    _KERNEL = chunk_cat
    return PATCH.install()


def restore_reduce_copy_in() -> None:
    """FSDP2's own `torch._chunk_cat` again (sharding.reduce_copy_in=torch, a CPU run, tests),
    unless something else has replaced the function since this module did."""
    PATCH.restore()
