"""`python -m src.run [OVERRIDES]`: compose -> validate -> dispatch on cfg.task.

Before Hydra creates a run directory, every job of the command (each combination of a -m sweep) is
composed and validated, so a typo or an impossible setting prints one line, exits 2 and leaves
nothing behind: no output directory, no rank, no MLflow run. Under torchrun or a SLURM step the
same entry is a worker: it composes the config itself and rank 0 alone writes the run directory.
"""
from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import DictConfig, OmegaConf, open_dict

from src.compose import ConfigError, compose_config
from src.distributed.env import launched_as_worker
from src.runtime import RunContext
from src.tasks import run_task
from src.tracking.mlflow_run import resolve_tracking_uri
from src.validate import validate

log = logging.getLogger("src.run")

# Hydra flags that print or inspect instead of running a job: no preflight for these.
_INSPECT_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--version", "--resolve", "-p", "--package")
EXIT_BAD_CONFIG = 2


def _job_overrides(overrides: list[str], multirun: bool) -> list[list[str]]:
    """Each job's overrides: one job, or every combination of a basic -m sweep."""
    user = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    if not multirun:
        return [user]
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides(user)
        return [job for batch in BasicSweeper.split_arguments(parsed, None) for job in batch]
    except Exception:  # a sweeper-specific syntax (ranges for Optuna, ...): its own sweeper checks it
        return []


def preflight(overrides: list[str], multirun: bool) -> None:
    for job in _job_overrides(overrides, multirun):
        validate(compose_config(job))


def _fail(message: str, code: int = EXIT_BAD_CONFIG) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(code)


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> dict | None:
    hc = HydraConfig.get()
    cwd = hc.runtime.cwd
    ctx = RunContext(
        run_dir=hc.runtime.output_dir,
        cwd=cwd,
        overrides=list(hc.overrides.task),
        tracking_uri=resolve_tracking_uri(cfg.tracking.uri, cwd),
    )
    try:
        validate(cfg)
    except ConfigError as err:
        _fail(str(err))
    return run_task(cfg, ctx)


def run_as_worker(overrides: list[str]) -> None:
    """Entry under torchrun / srun: this process is already one rank of the run."""
    cfg = compose_config(overrides, with_hydra=True)
    validate(cfg, as_worker=True)
    run_dir = Path(OmegaConf.select(cfg, "hydra.run.dir"))
    with open_dict(cfg):
        del cfg["hydra"]
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    cwd = os.getcwd()
    if rank == 0:
        run_dir = run_dir if run_dir.is_absolute() else Path(cwd) / run_dir
    ctx = RunContext(
        run_dir=str(run_dir) if rank == 0 else None,
        cwd=cwd,
        overrides=overrides,
        tracking_uri=resolve_tracking_uri(cfg.tracking.uri, cwd),
    )
    run_task(cfg, ctx)


def main() -> None:
    from hydra._internal.utils import get_args_parser

    args, _ = get_args_parser().parse_known_args(sys.argv[1:])
    inspecting = any(a.split("=")[0] in _INSPECT_FLAGS for a in sys.argv[1:])
    try:
        if launched_as_worker() and not inspecting:
            run_as_worker(args.overrides)
            return
        if not inspecting:
            preflight(args.overrides, args.multirun)
    except ConfigError as err:
        _fail(str(err))
    hydra_main()


if __name__ == "__main__":
    main()
