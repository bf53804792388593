"""What every task shares about the run beyond its config: where to write (RunContext), how it logs,
the resolved config it leaves, and the key settings its summary.json records."""
from __future__ import annotations

import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf


def installed_version(distribution: str) -> str:
    """The installed version of a pip distribution (what cache keys record); "" where it is not installed."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(distribution)
    except PackageNotFoundError:
        return ""


@dataclass
class RunContext:
    run_dir: str | None
    """the Hydra run (or sweep job) directory; rank 0 writes summary.json and logs there"""
    cwd: str
    """the directory the command was started in (relative paths, the sqlite store, git state)"""
    overrides: list[str] = field(default_factory=list)
    """the command-line overrides, for run names and tags"""
    tracking_uri: str = ""
    """the MLflow URI with relative sqlite paths made absolute"""
    parent_run_id: str | None = None
    """inside a Hydra multirun: the sweep's MLflow parent run"""
    sweep_keys: list[str] | None = None
    """inside a Hydra multirun: the keys the sweep varies, which name each job's run"""
    multirun: bool = False
    """a job of a Hydra multirun: the sweep's end, not the job's, prints where to see it"""
    verified_checkpoint: str | None = None
    """the checkpoint the launching process resumes from and has checked (its files against the
    manifest, its tensors against the model): the ranks load it without hashing it again"""


def world_size(cfg: DictConfig) -> int:
    """Ranks in the run's group: dist.nproc on each of dist.nnodes nodes (the faked group's size under dist.fake)."""
    return cfg.dist.nproc * cfg.dist.nnodes


def world_label(size: Any, fake: bool) -> Any:
    """The rank count as tables show it: a dist.fake run's ranks were one process and its speed leaves
    out the collectives, so `4 (faked)`."""
    return f"{size} (faked)" if fake and size is not None else size


def settings(cfg: DictConfig, world_size: int) -> dict[str, Any]:
    """The resolved key settings that summary.json records next to the figures."""
    return {
        "exp": cfg.exp,
        "model": cfg.model.name,
        "sharding": cfg.sharding.name,
        "precision": cfg.precision.name,
        "backend": cfg.backend.name,
        "kernels": cfg.kernels.name,
        "speed": cfg.speed.name,
        "data": cfg.data.name,
        "world_size": world_size,
        "dist_fake": bool(cfg.dist.fake),  # rank 0 alone, collectives faked: no figure here is the group's
        "batch_size_per_device": cfg.data.batch_size,
        "seq_len": cfg.data.seq_len,
        "steps": cfg.train.steps,
        "lr": cfg.optim.lr,
    }


def setup_logging(run_dir: Path | None, rank: int) -> None:
    """Spawned ranks start with bare logging: rank 0 logs to the console and to <run_dir>/run.log,
    other ranks log warnings only, so the console shows one copy of each line."""
    root = logging.getLogger()
    if getattr(root, "_perflab_configured", False):
        return
    level = logging.INFO if rank == 0 else logging.WARNING
    fmt = logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s")
    if not root.handlers:
        console = logging.StreamHandler(sys.stdout)
        console.setFormatter(fmt)
        root.addHandler(console)
    has_file = any(isinstance(h, logging.FileHandler) for h in root.handlers)  # Hydra's run.log, in-process
    if run_dir is not None and rank == 0 and not has_file:
        file_handler = logging.FileHandler(run_dir / "run.log")
        file_handler.setFormatter(fmt)
        root.addHandler(file_handler)
    root.setLevel(level)
    for noisy in ("alembic", "mlflow", "urllib3", "git"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    root._perflab_configured = True  # type: ignore[attr-defined]


def save_resolved_config(cfg: DictConfig, run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.yaml").write_text(OmegaConf.to_yaml(cfg, resolve=True))
