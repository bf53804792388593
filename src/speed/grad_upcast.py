"""speed.grad_upcast: FSDP2's post-reduce gradient upcast through kernels/triton/cast.py.

With reduce_dtype bf16 under fp32 parameters FSDP2 reduces each unit's gradients in bf16, then casts
the unit's flat reduce output to fp32 with `.to()`, which on torch 2.11 runs TensorIterator's
one-element-a-load casting copy at about half the copy ceiling. FSDP2 offers no hook between its
reduction and that cast, so the function it calls for it, `_fsdp_collectives._to_dtype_if_needed`
(a module global, looked up at each call), is replaced by one that sends contiguous bf16/fp16 ->
fp32 casts on a device the kernel runs on (CUDA; a CPU under Triton's interpreter) to the Triton
kernel, and every other call to FSDP2's own. The same bits: every bf16 and fp16 value is exact in fp32.
"""
from __future__ import annotations

import torch

from src.speed.patch import Patch
from src.speed.recipe import FSDP, Recipe
from src.speed.versions import TRITON_TESTED

_CAST = None  # perflab_kernels.triton.cast, imported when installed (Triton may be missing)
_RUNS_ON = None  # perflab_kernels.triton.device.kernels_run_on


def _to_dtype_if_needed(tensor: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if (dtype == torch.float32 and tensor.dtype in _CAST.UPCAST_DTYPES and tensor.is_contiguous()
            and not torch.compiler.is_compiling() and _RUNS_ON(tensor)):
        return _CAST.upcast_fp32(tensor)
    return PATCH.fsdp2["_to_dtype_if_needed"](tensor, dtype)


PATCH = Patch({"_to_dtype_if_needed": _to_dtype_if_needed})
COLLECTIVES = f"{FSDP}._fsdp_collectives:"


def install() -> bool:
    """Route FSDP2's post-reduce upcast through the Triton kernel; False (and nothing changed)
    where this torch's FSDP2 has no `_to_dtype_if_needed`, Triton is missing, or other code has
    replaced the function since an earlier install. Installing twice keeps the first install's original."""
    global _CAST, _RUNS_ON
    try:
        import perflab_kernels.triton.cast as cast
        from perflab_kernels.triton.device import kernels_run_on
    except ImportError:
        return False
    _CAST, _RUNS_ON = cast, kernels_run_on
    return PATCH.install()


def restore() -> None:
    """FSDP2's own cast again, unless something else has replaced the function since: theirs stays."""
    PATCH.restore()


RECIPE = Recipe(
    name="grad_upcast",
    does="upcasts FSDP2's reduced bf16/fp16 gradients to the fp32 parameters' dtype with a vectorised Triton kernel",
    replaces=(COLLECTIVES + "_to_dtype_if_needed",),
    reads=(),
    signatures={COLLECTIVES + "_to_dtype_if_needed": ("tensor", "dtype")},
    gain="0.5-1.0 ms a step of +exp=fsdp4_tuned: docs/RESULTS.md, Speed recipes",
    parity="tests/integration/test_grad_upcast.py::test_fsdp2_gradients_upcast_by_triton_equal_torchs_on_gloo",
    restore=restore,
    originals=lambda: PATCH.originals(COLLECTIVES),
    triton=TRITON_TESTED,
    notes=("pytorch/pytorch#195542 vectorises the upcast upstream; once torch's .to() runs at the copy ceiling, this recipe goes",),
)
