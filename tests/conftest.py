"""Shared helpers: run the real CLI in a subprocess, in a scratch directory, with a private MLflow store."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

# Triton kernels run in Triton's interpreter where there is no GPU; the variable must be set
# before any @triton.jit is applied, so before kernels/triton is imported.
try:
    import torch as _torch

    if not _torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
except ImportError:
    pass

REPO = Path(__file__).resolve().parent.parent


def run_cli(args: list[str], cwd: Path, timeout: int = 300, module: str = "src.run", launcher: list[str] | None = None) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    env.pop("HYDRA_FULL_ERROR", None)
    cmd = [sys.executable, *(launcher or []), "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in cwd.glob("outputs/*/*/.hydra")) + sorted(p.parent for p in cwd.glob("outputs/*/*/summary.json") if not (p.parent / ".hydra").exists())


def read_summary(cwd: Path) -> dict:
    (summary,) = list(cwd.glob("outputs/*/*/summary.json"))
    return json.loads(summary.read_text())


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path
