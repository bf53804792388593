"""FSDP2's post-reduce gradient upcast through kernels/triton/cast.py (`sharding.grad_upcast`).

With reduce_dtype bf16 and fp32 parameters (`+exp=fsdp4_tuned`), FSDP2 reduces each unit's
gradients in bf16 and then casts the unit's flat reduce output to fp32 with `.to()` on its
post-reduce stream. On torch 2.11 that cast moves 6 bytes a parameter at about 2.0 TB/s on an H200
where a vectorised one reaches 3.6-3.8 (kernels/triton/cast.py): 2.6 ms a step for mini_llm's 735M
parameters on one GPU (14 units; docs/PERFORMANCE.md 7), half that a GPU on two.

FSDP2 offers no hook between its reduction and that cast, so the function it calls for it,
`_fsdp_collectives._to_dtype_if_needed` (a module global, looked up at each call), is replaced by
one that sends contiguous CUDA bf16/fp16 -> fp32 casts to the Triton kernel and every other call to
the original. Process-wide; where the installed torch has no such function, or Triton is missing,
nothing changes and `use_triton_grad_upcast` says so.
"""
from __future__ import annotations

import torch

from src.distributed.fsdp_patch import CollectivesPatch

_CAST = None  # kernels.triton.cast, imported when installed (Triton may be missing)


def _to_dtype_if_needed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if (dtype == torch.float32 and tensor.dtype in _CAST.UPCAST_DTYPES and tensor.is_cuda
            and tensor.is_contiguous() and not torch.compiler.is_compiling()):
        return _CAST.upcast_fp32(tensor)
    return PATCH.fsdp2["_to_dtype_if_needed"](tensor, dtype)


PATCH = CollectivesPatch({"_to_dtype_if_needed": _to_dtype_if_needed})


def use_triton_grad_upcast() -> bool:
    """Route FSDP2's post-reduce upcast through the Triton kernel; False (and nothing changed)
    where this torch's FSDP2 has no `_to_dtype_if_needed`, Triton is missing, or other code has
    replaced the function since an earlier install. Installing twice keeps the first install's original."""
    global _CAST
    try:
        import kernels.triton.cast as cast
    except ImportError:
        return False
    _CAST = cast
    return PATCH.install()


def restore_grad_upcast() -> None:
    """FSDP2's own cast again (sharding.grad_upcast=torch, a CPU run, tests), unless something else
    has replaced the function since this module did: that one is left in place."""
    PATCH.restore()
