"""Plugin: run the real CLI in a subprocess, in a scratch directory, and read what the run left."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], cwd: Path, timeout: int = 300, module: str = "src.run", launcher: list[str] | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` in `cwd` with this checkout importable; `env`: variables set on top of this process's."""
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
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
