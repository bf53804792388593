"""Settings that compose but cannot run: checked before any rank, run directory or MLflow run exists.

Each check raises ConfigError with one line: the bad value, then the fix. This module keeps the
rules across groups (unknown keys, the tracking store, which backend runs which task on which
devices); each task's own checks live beside it: src/train/checks.py, src/edge/checks.py,
src/kernel_bench/checks.py, src/diagnose/checks.py.
"""
from __future__ import annotations

import os
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from src.compose import ConfigError
from src.config import GROUPS, RunConfig
from src.runtime import world_size
from src.train.checks import TRAINING_TASKS, check_training

TRAINING_BACKENDS = {"cpu", "cuda", "mps"}


def _check_group_keys(cfg: DictConfig) -> None:
    # `+model.dimm=3` (or `+foo=1`, `+optim.lr_max=1`) appends a key that no schema knows; it would
    # surface much later as a constructor error, or be ignored without a word, so refuse it here.
    top = {f.name for f in fields(RunConfig)}
    extra = sorted(set(cfg.keys()) - top - {"hydra"})
    if extra:
        raise ConfigError(f"{extra[0]}: unknown top-level key; valid ones: {', '.join(sorted(top - {'extra'}))} (free-form tags go in +extra.NAME=VALUE)")
    sections = {f.name: f.default_factory() for f in fields(RunConfig) if is_dataclass(f.default_factory if f.default_factory is not MISSING else None)}
    sections.update({group: schema for group, schema in GROUPS.items()})
    for section, schema in sections.items():
        known = {f.name for f in fields(schema)}
        extra = sorted(set(cfg[section].keys()) - known)
        if extra:
            raise ConfigError(f"{section}.{extra[0]}: unknown key in {section}; valid keys: {', '.join(sorted(known - {'name'}))}")


def _check_tracking_uri(cfg: DictConfig) -> None:
    """A sqlite store in a folder that does not exist: MLflow would create the folder (anywhere,
    `/nonexistent_dir/` at the filesystem root included) without a word."""
    uri = cfg.tracking.uri
    if not cfg.tracking.enabled:
        return
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        folder = (db if db.is_absolute() else Path(os.getcwd()) / db).parent
        if not folder.is_dir():
            raise ConfigError(f"tracking.uri={uri}: no folder {folder} for the database; create it first, or use tracking.uri=sqlite:///mlflow.db (here)")
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"tracking.uri={uri}: cannot write in {folder}; use tracking.uri=sqlite:///mlflow.db (here) or a writable folder")
    elif not uri.startswith(("http://", "https://", "databricks", "postgresql", "mysql", "mssql")):
        raise ConfigError(f"tracking.uri={uri}: MLflow 3 takes a database or a server here: sqlite:///mlflow.db, or http://HOST:PORT of `mlflow server`")


def _check_fake(cfg: DictConfig, as_worker: bool) -> None:
    """dist.fake runs rank 0 of the group alone: nothing that needs the other ranks to exist."""
    world = world_size(cfg)
    if world < 2:
        raise ConfigError(f"dist.fake=true fakes a group of dist.nproc x dist.nnodes ranks, here {world}; set dist.nproc=2 or more (the GPUs the run is meant for)")
    if as_worker:
        raise ConfigError("dist.fake=true runs the group's rank 0 alone in this process; start it with `python -m src.run`, not torchrun or srun")
    if cfg.sharding.strategy not in ("fsdp2", "hsdp"):
        # DDP's reducer reads a tensor back from each all-reduce's future, and a faked one returns none
        raise ConfigError(f"dist.fake=true fakes FSDP2's group, and sharding={cfg.sharding.name} replicates the model with DDP, whose gradient "
                          "all-reduce needs a real group; use sharding=fsdp2 or hsdp")
    ck = cfg.checkpoint
    if ck.enabled or ck.resume not in ("auto", "none") or ck.export_safetensors:
        raise ConfigError("dist.fake=true: rank 0 alone holds 1/N of the weights, so it can neither write a whole checkpoint (nor model.safetensors) "
                          "nor load one; set checkpoint.enabled=false checkpoint.resume=none checkpoint.export_safetensors=false")
    if cfg.speed.symm_mem:
        raise ConfigError("speed.symm_mem=true maps the other ranks' buffers, and under dist.fake=true they do not exist; drop one of them")
    if cfg.fault.kind != "none" and cfg.fault.rank != 0:
        raise ConfigError(f"fault.rank={cfg.fault.rank} never runs under dist.fake=true (rank 0 alone); set fault.rank=0")


def validate(cfg: DictConfig, cuda_device_count: int | None = None, mps_available: bool | None = None, as_worker: bool = False,
             cuda_capability: tuple[tuple[int, int] | None, str] | None = None) -> None:
    """Raise ConfigError for the first impossible combination. Device facts are probed unless given
    (tests pass them to check the messages for hardware this machine lacks): `cuda_capability` is
    (the lowest compute capability of the visible GPUs, that GPU's name)."""
    _check_group_keys(cfg)
    _check_tracking_uri(cfg)
    backend, task, sharding = cfg.backend.name, cfg.task.name, cfg.sharding
    nproc = cfg.dist.nproc
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if mps_available is None:
        mps_available = torch.backends.mps.is_available()

    if cfg.dist.fake and task not in TRAINING_TASKS:  # before the one-process tasks' own checks, which return
        raise ConfigError(f"dist.fake=true fakes a training run's group, and task={task} runs in one process already; drop dist.fake")
    if task in TRAINING_TASKS and backend not in TRAINING_BACKENDS:
        raise ConfigError(f"backend={backend} cannot train; use it with task=infer (+exp=edge), or train with backend=cpu or backend=cuda")
    if task == "infer":  # one process, one device: none of the training checks apply
        from src.edge.checks import check_infer

        check_infer(cfg, backend, cuda_device_count, mps_available)
        return
    if task == "kernel_bench":  # one process, one device: none of the training checks apply
        from src.kernel_bench.checks import check_kernel_bench

        check_kernel_bench(cfg, backend, cuda_device_count)
        return
    if task == "diagnose":
        from src.diagnose.checks import check_diagnose

        if check_diagnose(cfg, backend, cuda_device_count):  # diagnosing a report runs nothing on a device
            return
    if cfg.profile.nvtx and backend != "cuda":
        raise ConfigError(f"profile.nvtx=true marks ranges for Nsight tools on an NVIDIA GPU; with backend={backend} use +exp=profile (torch.profiler)")
    if backend == "cuda" and cuda_device_count == 0:
        raise ConfigError("backend=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False); use backend=cpu, or run on a machine with an NVIDIA GPU")
    if backend == "mps" and not mps_available:
        raise ConfigError("backend=mps but torch.backends.mps.is_available() is False (MPS needs Apple Silicon and macOS 12.3+); use backend=cpu")
    if task in TRAINING_TASKS and backend == "mps" and (sharding.strategy != "none" or nproc != 1):
        raise ConfigError(f"backend=mps trains on one device only (sharding={sharding.name}, dist.nproc={nproc}); use sharding=none dist.nproc=1")
    if nproc < 1 or cfg.dist.nnodes < 1:
        raise ConfigError(f"dist.nproc={nproc} dist.nnodes={cfg.dist.nnodes}: both must be at least 1")
    if cfg.dist.fake:
        _check_fake(cfg, as_worker)
    elif backend == "cuda" and not as_worker and nproc > cuda_device_count:
        raise ConfigError(f"dist.nproc={nproc} but only {cuda_device_count} GPU(s) are present; set dist.nproc={cuda_device_count} or less, "
                          f"or add dist.fake=true to try rank 0 of {nproc} on one GPU (sharding, memory, compile; not speed)")

    check_training(cfg, cuda_device_count, cuda_capability)
