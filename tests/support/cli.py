"""Plugin: run the real CLI in a subprocess, in a scratch directory, and read what the run left."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def run_cli(args: list[str], cwd: Path, timeout: int = 300, module: str = "src.run", launcher: list[str] | None = None,
            env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m module args` in `cwd` with this checkout importable; `env`: variables set on top of this process's."""
    cmd = [sys.executable, *(launcher or []), "-m", module, *args]
    return subprocess.run(cmd, cwd=cwd, env=_env(env), capture_output=True, text=True, timeout=timeout)


def _env(env: dict[str, str] | None = None) -> dict[str, str]:
    env = {**os.environ, **(env or {})}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO), env.get("PYTHONPATH")]))
    env.pop("HYDRA_FULL_ERROR", None)
    return env


def run_dirs(cwd: Path) -> list[Path]:
    return sorted(p.parent for p in cwd.glob("outputs/*/*/.hydra")) + sorted(p.parent for p in cwd.glob("outputs/*/*/summary.json") if not (p.parent / ".hydra").exists())


def read_summary(cwd: Path) -> dict:
    (summary,) = list(cwd.glob("outputs/*/*/summary.json"))
    return json.loads(summary.read_text())


@pytest.fixture
def workdir(tmp_path: Path) -> Path:
    return tmp_path


@pytest.fixture(scope="session")
def mlflow_store_template(tmp_path_factory) -> Path:
    """An MLflow SQLite store with its tables made and nothing in them, made once per worker by the
    project's own client_for, as a run makes a new store. MLflow makes a new store's tables by
    replaying its whole schema history: about 1 s of CPU, and several seconds of fsyncs on a busy
    disk, in every run that tracks into a folder of its own. Made in a process of its own: client_for
    sets MLflow's environment, which this process's runs would inherit."""
    path = tmp_path_factory.mktemp("mlflow_store_template") / "mlflow.db"
    make = f"from src.tracking.mlflow_run import client_for; client_for({f'sqlite:///{path}'!r})"
    proc = subprocess.run([sys.executable, "-c", make], cwd=path.parent, env=_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and path.is_file(), proc.stderr[-3000:]
    return path


@pytest.fixture(scope="session")
def mlflow_store(mlflow_store_template: Path) -> Callable[..., str]:
    """`mlflow_store(folder)` puts a made, empty store at folder/mlflow.db (what tracking.uri's
    default names) and returns its URI: the run then opens a store as every run after a folder's
    first does. Tests of a store's first run (its tables made under a lock while another run waits)
    start without one."""

    def place(folder: Path, name: str = "mlflow.db") -> str:
        shutil.copyfile(mlflow_store_template, folder / name)
        return f"sqlite:///{folder / name}"

    return place
