"""task=diagnose's own settings checks (src/config/validate.py runs them)."""
from __future__ import annotations

import os

from omegaconf import DictConfig

from src.config.compose import ConfigError
from src.diagnose.task import NO_GPU


def check_diagnose(cfg: DictConfig, backend: str, cuda_device_count: int) -> bool:
    """True when the run diagnoses an existing report (nothing runs on a device: no more checks);
    else ncu needs a GPU, and the training checks follow (the step it profiles is a training step)."""
    if cfg.diagnose.report:
        if not os.path.isfile(cfg.diagnose.report):
            raise ConfigError(f"diagnose.report={cfg.diagnose.report}: no such file; give an .ncu-rep or its --csv --page raw export")
        return True
    if backend != "cuda" or cuda_device_count == 0:
        raise ConfigError(NO_GPU)
    return False
