"""cfg.task.name -> the function that runs it. Each takes the composed config and the RunContext."""
from __future__ import annotations

import logging
import sys
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable

from omegaconf import DictConfig, OmegaConf

from src.distributed.env import launched_as_worker
from src.runtime import RunContext

log = logging.getLogger("src.run")


def run_train(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """task=train and task=profile: in this process for one rank, else through the elastic launcher."""
    from src.distributed.launch import RankFailed, launch_ranks
    from src.tracking.mlflow_run import fail_dangling_run, write_json
    from src.train.worker import elastic_entry, save_resolved_config, settings, train

    run_dir = Path(ctx.run_dir) if ctx.run_dir else None
    if run_dir is not None:
        save_resolved_config(cfg, run_dir)
    if launched_as_worker() or (cfg.dist.nproc == 1 and cfg.dist.nnodes == 1):
        return train(cfg, ctx)
    try:
        results = launch_ranks(
            elastic_entry,
            (OmegaConf.to_container(cfg, resolve=True), asdict(ctx)),
            nproc=cfg.dist.nproc,
            nnodes=cfg.dist.nnodes,
            max_restarts=cfg.dist.max_restarts,
            rdzv_endpoint=cfg.dist.rdzv_endpoint,
        )
    except RankFailed as err:
        if run_dir is not None:
            if cfg.tracking.enabled:
                fail_dangling_run(run_dir, ctx.tracking_uri or cfg.tracking.uri, str(err))
            write_json(run_dir / "summary.json", {"task": cfg.task.name, "status": "failed", "error": str(err), "settings": settings(cfg, cfg.dist.nproc * cfg.dist.nnodes)})
        sys.stderr.write(f"error: {err}\n")
        sys.exit(1)
    return results[min(results)]


def run_diagnose(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    from src.profiling.ncu_runner import run_diagnose as diagnose

    return diagnose(cfg, ctx)


TASKS: dict[str, Callable[[DictConfig, RunContext], Any]] = {
    "train": run_train,
    "profile": run_train,  # the training loop under torch.profiler (src/profiling/torch_profile.py)
    "diagnose": run_diagnose,
}


def run_task(cfg: DictConfig, ctx: RunContext) -> Any:
    return TASKS[cfg.task.name](cfg, ctx)
