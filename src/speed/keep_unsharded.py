"""speed.keep_unsharded: FSDP2's unsharded parameters kept in the same memory from one unshard to the next.

FSDP2 frees a unit's unsharded parameters when it reshards (after forward with
reshard_after_forward, after backward always) by resizing their storage to 0, and its next unshard
resizes it back: the all-gather's copy-out lands wherever the caching allocator puts it that time.
Inductor's CUDA graphs (speed.cudagraphs) record a compiled block with its weights' addresses and
record it again when one moves; kept, every unshard's copy-out writes the same memory and a graph
recorded once replays with the weights of every later step. A unit whose parameters are all kept
no longer reshards after forward (that would free nothing), so backward gathers nothing. The cost
is memory: the whole model's param_dtype copy stays on every GPU.

torch 2.15 has this as FSDP2's own `FSDPModule.set_keep_unsharded_storage` (each FSDPParam's
`keep_unsharded_storage`), taken wherever it exists. On older torch the recipe below replaces
`FSDPParam.free_unsharded_param` with one that leaves a marked parameter's storage alone; it goes
once torch 2.14 is no longer supported.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

from src.speed.patch import Patch
from src.speed.recipe import FSDP, Recipe

KEPT = "_kept_unsharded_storage"  # an FSDPParam whose unsharded storage stays (either way)
PARAM = f"{FSDP}._fsdp_param:"


def public() -> bool:
    """Whether this torch's FSDP2 keeps unsharded storage itself (torch 2.15+)."""
    return hasattr(FSDPModule, "set_keep_unsharded_storage")


def _fsdp_param_class():
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return FSDPParam


def _free_unsharded_param(self) -> None:
    if self.__dict__.get(KEPT):
        return  # kept: the next unshard's copy-out writes the same memory
    return FREE.fsdp2["free_unsharded_param"](self)


FREE = Patch({"free_unsharded_param": _free_unsharded_param}, owner=_fsdp_param_class)


def mark_kept(fsdp_param) -> bool:
    """Keep `fsdp_param`'s unsharded storage from now on: FSDP2's own flag where it has one, else
    the replaced `free_unsharded_param`; False (nothing marked) where neither can be had."""
    if public():
        fsdp_param.keep_unsharded_storage = True
    elif not FREE.install():
        return False
    fsdp_param.__dict__[KEPT] = True
    return True


def restore() -> None:
    """FSDP2's own free_unsharded_param again (parameters marked kept are freed as usual from then on)."""
    FREE.restore()


def module_groups(model: nn.Module):
    """(FSDP2 module, its parameter groups) for every FSDP2 module of `model` (torch 2.13 can give
    a module several groups)."""
    for m in model.modules():
        if isinstance(m, FSDPModule):
            state = m._get_fsdp_state()
            groups = state._fsdp_param_groups if hasattr(state, "_fsdp_param_groups") else [state._fsdp_param_group]
            yield m, [g for g in groups if g is not None]


def keep_unsharded(model: nn.Module, param_dtype: torch.dtype | None) -> tuple[int, int]:
    """Keep the unsharded storage of every parameter of `model`'s FSDP2 units, and stop each unit
    resharding after forward. Returns (parameters kept, bytes their unsharded copies hold in
    `param_dtype`, or their own dtype where None); (0, 0) and nothing changed where neither FSDP2's
    own flag nor the recipe can be had."""
    if public():  # every parameter is some unit's (the root holds the rest)
        for unit in (m for m in model.modules() if isinstance(m, FSDPModule)):
            unit.set_keep_unsharded_storage(True, recurse=False)
            unit.set_reshard_after_forward(False, recurse=False)
        params = list(model.parameters())
        return len(params), sum(p.numel() * (param_dtype or p.dtype).itemsize for p in params)
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


RECIPE = Recipe(
    name="keep_unsharded",
    does="keeps FSDP2's gathered parameters in the same memory between steps",
    replaces=(PARAM + "FSDPParam.free_unsharded_param",),
    reads=(f"{FSDP}._fsdp_param_group:FSDPParamGroup.fsdp_params",
           PARAM + "FSDPParam._orig_size", PARAM + "FSDPParam.sharded_param"),
    signatures={PARAM + "FSDPParam.free_unsharded_param": ("self",)},
    gain="what speed.cudagraphs needs under FSDP2: docs/RESULTS.md, Speed recipes (speed.cudagraphs)",
    parity="tests/integration/test_kept_unshard.py::test_kept_training_is_the_same_bits_as_fsdp2s_own",
    restore=restore,
    originals=lambda: FREE.originals(PARAM + "FSDPParam."),
    torch=("2.11", "2.13", "2.14"),
    switch=True,
    native=lambda: "FSDP2's own FSDPModule.set_keep_unsharded_storage" if public() else None,
    notes=("torch 2.15+: FSDP2's own FSDPModule.set_keep_unsharded_storage instead (public), so the recipe is not used there",),
)
