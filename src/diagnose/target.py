"""The process ncu profiles for task=diagnose: `python -m src.diagnose.target CONFIG.yaml RUN_DIR`.

CONFIG is a resolved run config (src/diagnose/task.py writes it); it is checked against the
schemas again and trained on one rank, with step `profile.nvtx_step` between cudaProfilerStart/Stop.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from omegaconf import OmegaConf

from src.config import RunConfig
from src.runtime import RunContext
from src.train.worker import train


def main(config_path: str, run_dir: str) -> None:
    cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(config_path))
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    train(cfg, RunContext(run_dir=run_dir, cwd=os.getcwd()))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
