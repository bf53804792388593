"""speed.gather_copy_in: FSDP2's all-gather copy-in in one pass.

Under mixed precision (fp32 sharded parameters, bf16 gathered ones) FSDP2 builds each unit's
all-gather input in two passes: `_get_param_all_gather_inputs` casts every sharded parameter into a
staging buffer of param_dtype (read 4 bytes, write 2), and `all_gather_copy_in` then copies that
buffer into the all-gather buffer's slice for this rank (read 2, write 2): 10 bytes a parameter where
6 would do, and a unit's worth of staging memory.

Here the cast writes straight into the all-gather buffer: the inputs function hands FSDP2 the fp32
shards themselves, the metadata function reports param_dtype for them (the dtype FSDP2 allocates
the all-gather buffer in and later views it as), and `all_gather_copy_in`'s `_foreach_copy_` into
that buffer then casts each shard as it copies (the same fp32 -> bf16 copy as FSDP2's first pass,
round to nearest even, so the gathered parameters are the same bits). With one rank FSDP2 gathers
nothing, so this changes a run only on two or more ranks.

The two module globals of `_fsdp_collectives` FSDP2 looks up at each all-gather are replaced, and
they work only as a pair: the inputs function takes its fast path only while the metadata function
in place is this module's. Groups the fast path does not cover (no param_dtype, CPU offload, tensor
subclasses with their own `fsdp_pre_all_gather` such as float8 weights, mixed param_dtypes; the test
is FSDP2's own `use_foreach_copy` in `_get_param_all_gather_inputs`), and anything traced under
torch.compile, go to FSDP2's own functions unchanged.
"""
from __future__ import annotations

import threading

import torch

from src.speed.patch import Patch, collectives
from src.speed.recipe import FSDP, Recipe

_PENDING = threading.local()  # the inputs list just handed out and its all-gather dtype; the
# metadata call that follows in foreach_all_gather (same thread) takes it. Backward's re-gathers run
# on autograd's device thread, so the state is per thread.


def _one_pass_dtype(fsdp_params) -> torch.dtype | None:
    """The group's param_dtype where every parameter takes FSDP2's plain cast-and-copy path with
    the same param_dtype; None where any does not (that group keeps FSDP2's own path)."""
    if not fsdp_params:
        return None
    dtype = fsdp_params[0].param_dtype
    for p in fsdp_params:
        if (p.param_dtype is None or p.param_dtype != dtype or p.offload_to_cpu
                or hasattr(p._sharded_local_tensor, "fsdp_pre_all_gather")):
            return None
    return dtype


def _sharded_source(fsdp_param) -> torch.Tensor:
    """What FSDP2's fast path casts: the padded flat shard, or the kept post-forward shard
    (reshard_after_forward=int), which is already in param_dtype."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

    if fsdp_param.sharded_state == ShardedState.SHARDED:
        return fsdp_param._sharded_param_data
    return fsdp_param._sharded_post_forward_param_data


@torch.no_grad()
def _get_param_all_gather_inputs(fsdp_params) -> list[list[torch.Tensor]]:
    if torch.compiler.is_compiling():
        return PATCH.fsdp2["_get_param_all_gather_inputs"](fsdp_params)
    dtype = _one_pass_dtype(fsdp_params)
    if dtype is None or collectives()._get_all_gather_input_metadatas is not _get_all_gather_input_metadatas:
        _PENDING.inputs = None
        return PATCH.fsdp2["_get_param_all_gather_inputs"](fsdp_params)
    inputs = [[_sharded_source(p)] for p in fsdp_params]
    _PENDING.inputs, _PENDING.dtype = inputs, dtype
    return inputs


def _handed_out(pending, param_all_gather_inputs) -> bool:
    """Whether FSDP2 passed the fp32 shards the inputs function just handed out (the same list, or
    a copy of it made by a wrapper of that function)."""
    if pending is None:
        return False
    if pending is param_all_gather_inputs:
        return True
    return len(pending) == len(param_all_gather_inputs) and all(
        len(ts) == 1 and ts[0] is ps[0] for ts, ps in zip(param_all_gather_inputs, pending))


def _get_all_gather_input_metadatas(param_all_gather_inputs):
    if torch.compiler.is_compiling():
        return PATCH.fsdp2["_get_all_gather_input_metadatas"](param_all_gather_inputs)
    pending = getattr(_PENDING, "inputs", None)
    _PENDING.inputs = None
    if not _handed_out(pending, param_all_gather_inputs):  # not the fp32 shards: FSDP2's own
        return PATCH.fsdp2["_get_all_gather_input_metadatas"](param_all_gather_inputs)
    dtype = _PENDING.dtype
    dtypes = [[dtype] for _ in param_all_gather_inputs]
    numels = [[t.numel() for t in ts] for ts in param_all_gather_inputs]
    return dtypes, numels, dtype


PATCH = Patch({"_get_param_all_gather_inputs": _get_param_all_gather_inputs,
                          "_get_all_gather_input_metadatas": _get_all_gather_input_metadatas})


def install() -> bool:
    """Cast straight into the all-gather buffer; False (and nothing changed) where this torch's
    FSDP2 lacks either function, or something else has replaced them since an earlier install."""
    return PATCH.install()


def restore() -> None:
    """FSDP2's two passes again, unless something else has replaced the functions since this module
    did: theirs are left in place."""
    PATCH.restore()


COLLECTIVES = f"{FSDP}._fsdp_collectives:"
PARAM = f"{FSDP}._fsdp_param:"

RECIPE = Recipe(
    name="gather_copy_in",
    does="casts each fp32 shard straight into FSDP2's all-gather buffer (one pass, 6 bytes a parameter where FSDP2 moves 10)",
    replaces=(COLLECTIVES + "_get_param_all_gather_inputs", COLLECTIVES + "_get_all_gather_input_metadatas"),
    reads=(PARAM + "ShardedState", PARAM + "FSDPParam.param_dtype", PARAM + "FSDPParam.offload_to_cpu",
           PARAM + "FSDPParam._sharded_local_tensor", PARAM + "FSDPParam.sharded_state", PARAM + "FSDPParam._sharded_param_data",
           PARAM + "FSDPParam._sharded_post_forward_param_data"),
    signatures={COLLECTIVES + "_get_param_all_gather_inputs": ("fsdp_params",),
                COLLECTIVES + "_get_all_gather_input_metadatas": ("param_all_gather_inputs",)},
    gain="not measured: it changes only runs of two or more GPUs (docs/RESULTS.md, FSDP2's copies)",
    parity="tests/test_copy_in.py::test_one_pass_copy_in_gathers_the_same_bits_as_fsdp2s_two",
    restore=restore,
    originals=lambda: PATCH.originals(COLLECTIVES),
)
