"""FSDP2's all-gathers into NCCL symmetric memory (`sharding.symm_mem`).

NCCL runs an all-gather whose output buffer is registered as a symmetric window on its copy
engines under the zero-CTA policy (NCCL_CTA_POLICY=2, NCCL 2.28+), so the gathers take no SM from
the GEMMs they overlap. In a trace of the tuned seed step over 2 H200s (docs/PERFORMANCE.md 7) the
GEMM kernels that ran beside an NCCL kernel took 1.1-1.45x the median of the same kernels running
alone: about 2 ms of the 72 ms step.

Two ways in, whichever the installed torch has:
- `FSDPModule.set_symm_mem_for_comm()` (FSDP2's own, newer torch);
- `FSDPModule.set_custom_all_gather(comm)` with NCCL's symmetric-memory pool
  (`torch.distributed._symmetric_memory.get_mem_pool`): `SymmMemAllGather` below allocates each
  all-gather output from that pool and rendezvouses it before the collective, which is what the
  former does. The reduce-scatters stay as they are (NCCL's symmetric reduce-scatter sums only).
"""
from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule


def _symm_mem_pools() -> bool:
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError:
        return False
    return all(hasattr(symm_mem, f) for f in ("set_backend", "get_mem_pool", "rendezvous")) and hasattr(torch.cuda, "use_mem_pool")


def symm_mem_route() -> str | None:
    """`fsdp2` (FSDP2's set_symm_mem_for_comm), `custom` (its set_custom_all_gather with NCCL's
    symmetric-memory pool), or None when this torch has neither."""
    if hasattr(FSDPModule, "set_symm_mem_for_comm"):
        return "fsdp2"
    if hasattr(FSDPModule, "set_custom_all_gather") and _symm_mem_pools():
        return "custom"
    return None


def _all_gather_base() -> type:
    from torch.distributed.fsdp._fully_shard._fsdp_api import AllGather

    return AllGather


def symm_mem_all_gather() -> object:
    """An FSDP2 all-gather comm whose outputs live in NCCL's symmetric-memory pool."""
    import torch.distributed._symmetric_memory as symm_mem

    class SymmMemAllGather(_all_gather_base()):
        def allocate(self, size: Sequence[int], *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
            # one pool per device: a segment is registered (and rendezvoused) once and reused by
            # every later gather of the same size, as the caching allocator reuses any block
            with torch.cuda.use_mem_pool(symm_mem.get_mem_pool(device)):
                return torch.empty(size, dtype=dtype, device=device)

        def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup, async_op: bool = False):
            symm_mem.rendezvous(output_tensor, group=group.group_name)  # the gather writes into every rank's window
            return dist.all_gather_into_tensor(output_tensor, input_tensor, group=group, async_op=async_op)

    return SymmMemAllGather()


def use_symm_mem(model: nn.Module, mesh) -> str:
    """Every FSDP unit's all-gathers into symmetric memory; returns the route taken. `mesh`: the
    FSDP mesh, whose last dimension is the group the gathers run over (hsdp's dp_shard)."""
    route = symm_mem_route()
    if route is None:
        raise RuntimeError(f"torch {torch.__version__} has neither FSDP2's set_symm_mem_for_comm nor set_custom_all_gather with symmetric-memory pools")
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    if route == "fsdp2":
        for unit in units:  # per unit: it changes only the module it is called on
            unit.set_symm_mem_for_comm()
        return route
    import torch.distributed._symmetric_memory as symm_mem

    symm_mem.set_backend("NCCL")
    # the gathers' NCCL communicator exists before the first rendezvous looks for it: a subgroup's
    # (hsdp's dp_shard) is created lazily, at its first collective
    dist.barrier(group=mesh.get_group(mesh.ndim - 1))
    comm = symm_mem_all_gather()
    for unit in units:
        unit.set_custom_all_gather(comm)
    return route
