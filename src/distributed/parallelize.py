"""Apply the sharding strategy to a plain model built on the meta device, then materialise it.

fsdp2 / hsdp: `fully_shard` on each transformer block, then on the root, over an explicit mesh
(torchtitan's order: the root's group then holds only the embedding and head). none: the full
model on every rank, gradients all-reduced by DDP when there is more than one rank.
"""
from __future__ import annotations

import zlib

import torch
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor

from src.dtypes import torch_dtype


def mixed_precision_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
) -> nn.Module:
    """Per-block fully_shard, then the root. Each block's parameters are all-gathered just before its
    forward and freed after it (reshard_after_forward), so peak memory holds one full block at a time.
    """
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # The root's parameters (embedding, head) are needed again at the start of backward: keeping
    # them gathered after forward saves one all-gather of the largest matrices for free memory.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    return model


def _full_init_tensor(kind: str, std: float, shape: torch.Size, seed: int, name: str, device: torch.device) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    # One generator per parameter, seeded by the run seed and the parameter's name: the full
    # tensor is the same on every rank and for every world size, whatever order params come in.
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


@torch.no_grad()
def materialize_and_init(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate a meta-device (possibly sharded) model on `device` and fill it deterministically.

    For a DTensor parameter each rank draws the full tensor and keeps its own shard
    (distribute_tensor with src_data_rank=None slices locally, no communication).
    """
    model.to_empty(device=device)
    for name, param in model.named_parameters():
        name = name.replace("_orig_mod.", "").replace("_fsdp_wrapped_module.", "")
        kind, std = model.param_init(name)
        if isinstance(param, DTensor):
            full = _full_init_tensor(kind, std, param.shape, seed, name, param.to_local().device)
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(_full_init_tensor(kind, std, param.shape, seed, name, param.device))
    return model
