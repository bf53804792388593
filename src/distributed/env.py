"""Who this process is (rank, world, device) and the process group / device mesh it trains on."""
from __future__ import annotations

import datetime
import os
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

_SLURM_TO_TORCH = {"SLURM_PROCID": "RANK", "SLURM_NTASKS": "WORLD_SIZE", "SLURM_LOCALID": "LOCAL_RANK"}


def launched_as_worker() -> bool:
    """True under torchrun / torch.distributed.run or a multi-task SLURM step: the ranks already exist.

    Not in a submitit task (hydra/launcher=submitit_*): there each SLURM task is one node's elastic
    agent, which starts the ranks itself (src/distributed/cluster.py), whatever SLURM_NTASKS says."""
    if "TORCHELASTIC_RUN_ID" in os.environ or ("RANK" in os.environ and "WORLD_SIZE" in os.environ):
        return True
    if os.environ.get("SUBMITIT_EXECUTOR"):
        return False
    return int(os.environ.get("SLURM_NTASKS", "1")) > 1 and "SLURM_PROCID" in os.environ


def adopt_slurm_env() -> None:
    """Map SLURM's task variables onto torch's, so `srun python -m src.run` needs only MASTER_ADDR/PORT."""
    if "RANK" in os.environ or "SLURM_PROCID" not in os.environ or os.environ.get("SUBMITIT_EXECUTOR"):
        return
    for slurm, torch_name in _SLURM_TO_TORCH.items():
        if slurm in os.environ:
            os.environ.setdefault(torch_name, os.environ[slurm])


@dataclass(frozen=True)
class DistEnv:
    rank: int
    world_size: int
    local_rank: int
    device: torch.device

    @property
    def is_main(self) -> bool:
        return self.rank == 0


def init_distributed(device_type: str, dist_backend: str | None, timeout_s: int = 600, fake_world: int = 0) -> DistEnv:
    """Initialise the default process group (a one-rank group when not launched) and pick the device.

    A one-rank group keeps a single code path: FSDP2 needs a mesh even on one device, and a
    HashStore needs no port. `fake_world` > 1 (dist.fake): this process is rank 0 of a group that
    size whose collectives are torch's fake ones, on device 0.
    """
    if fake_world > 1:
        return _init_fake(device_type, fake_world, timeout_s)
    adopt_slurm_env()
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
        device = torch.device("cuda", local_rank)
    else:
        device = torch.device(device_type)
    if not dist.is_initialized() and dist_backend:
        timeout = datetime.timedelta(seconds=timeout_s)
        if world == 1 and "MASTER_ADDR" not in os.environ:
            dist.init_process_group(dist_backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        else:
            kwargs = {"device_id": device} if device_type == "cuda" else {}
            restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            agent_store = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
            if restart != "0" and agent_store:
                # After an elastic restart the agent's TCPStore still holds the previous attempt's
                # keys under the same names (gloo's peer addresses among them), so a new rank can
                # dial a dead one ("connectFullMesh ... Connection refused"): give every attempt
                # a prefix of its own. One node only: there one agent counts the restarts of all
                # ranks. Several nodes (launch_ranks) get a fresh store each attempt instead.
                store = dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), world, is_master=False, timeout=timeout)
                kwargs.update(store=dist.PrefixStore(f"perflab/restart_{restart}", store), rank=rank, world_size=world)
            dist.init_process_group(dist_backend, timeout=timeout, **kwargs)
    return DistEnv(rank, world, local_rank, device)


def _init_fake(device_type: str, world: int, timeout_s: int) -> DistEnv:
    """Rank 0 of `world` ranks, alone: the fake backend answers every collective in this process
    (torch.testing's fake_pg module registers it; a FakeStore needs no peers)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    device = torch.device(device_type, 0) if device_type == "cuda" else torch.device(device_type)
    if device_type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world, timeout=datetime.timedelta(seconds=timeout_s))
    return DistEnv(0, world, 0, device)


def build_mesh(device_type: str, world_size: int, strategy: str, replicate: int) -> DeviceMesh:
    """1-D mesh of all ranks for fsdp2/none; (replicate, shard) 2-D mesh for hsdp."""
    if strategy == "hsdp":
        return init_device_mesh(device_type, (replicate, world_size // replicate), mesh_dim_names=("dp_replicate", "dp_shard"))
    return init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))


def shutdown() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()
