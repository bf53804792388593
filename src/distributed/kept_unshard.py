"""sharding.keep_unsharded: FSDP2's unsharded parameters kept in the same memory from one unshard to the next.

FSDP2 frees a unit's unsharded parameters when it reshards (after forward with
reshard_after_forward, after backward always) by resizing their storage to 0, and its next unshard
resizes it back: the all-gather's copy-out lands wherever the caching allocator puts it that time.
Inductor's CUDA graphs (kernels.cudagraphs) record a compiled block with its weights' addresses and
record it again when one moves (summary.json's cudagraph_rerecords); a weight that moves every step
would have its block recorded every step, then launched one kernel at a time past Inductor's limit
of re-records. Kept, `free_unsharded_param` leaves the storage alone, so every unshard's copy-out
writes the same memory and a graph recorded once replays with the weights of every later step.

A unit whose parameters are all kept no longer reshards after forward (resharding would free
nothing, and backward would gather the same weights again into the same memory), so backward does
without its second all-gather of every block. The cost is memory: the whole model's param_dtype copy
stays on every GPU (2 bytes a parameter in bf16, 1.46 GB for mini_llm), which with
reshard_after_forward=false is already resident from the end of forward to the end of backward,
the step's peak. On one rank, optim.cast_in_step keeps the storage the same way
(src/distributed/one_rank.py) and marks it here.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from src.distributed.fsdp_patch import CollectivesPatch

KEPT = "_kept_unsharded_storage"  # an FSDPParam whose unsharded storage free_unsharded_param leaves alone


def _fsdp_param_class():
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return FSDPParam


def _free_unsharded_param(self) -> None:
    if self.__dict__.get(KEPT):
        return  # kept: the next unshard's copy-out writes the same memory
    return FREE.fsdp2["free_unsharded_param"](self)


FREE = CollectivesPatch({"free_unsharded_param": _free_unsharded_param}, owner=_fsdp_param_class)


def mark_kept(fsdp_param) -> bool:
    """Keep `fsdp_param`'s unsharded storage from now on; False (nothing marked) where this torch's
    FSDPParam has no `free_unsharded_param` or other code has replaced it."""
    if not FREE.install():
        return False
    fsdp_param.__dict__[KEPT] = True
    return True


def module_groups(model: nn.Module):
    """(FSDP2 module, its parameter groups) for every FSDP2 module of `model` (torch 2.13 can give
    a module several groups)."""
    from torch.distributed.fsdp import FSDPModule

    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = state._fsdp_param_groups if hasattr(state, "_fsdp_param_groups") else [state._fsdp_param_group]
            yield m, [g for g in groups if g is not None]


def keep_unsharded(model: nn.Module, param_dtype: torch.dtype | None) -> tuple[int, int]:
    """Keep the unsharded storage of every parameter of `model`'s FSDP2 units, and stop each unit
    resharding after forward. Returns (parameters kept, bytes their unsharded copies hold in
    `param_dtype`, or their own dtype where None); (0, 0) and nothing changed where FSDP2's method
    cannot be replaced."""
    n = nbytes = 0
    for module, groups in module_groups(model):
        for group in groups:
            for p in group.fsdp_params:
                if not mark_kept(p):
                    return 0, 0
                n += 1
                nbytes += p._orig_size.numel() * (param_dtype or p.sharded_param.dtype).itemsize
        if groups:
            module.set_reshard_after_forward(False, recurse=False)
    return n, nbytes
