"""Shared helpers: run the real CLI in a subprocess, in a scratch directory, with a private MLflow store."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch as _torch

# Triton kernels run in Triton's interpreter where there is no GPU; the variable must be set
# before any @triton.jit is applied, so before kernels/triton is imported.
if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO = Path(__file__).resolve().parent.parent


# What a test needs of the machine, said once for the suite. needs_gpu asks is_available() alone:
# reading the capability runs torch.cuda's lazy init, after which a forked child of this process
# refuses CUDA, so only the files that ask for a capability read it.
needs_gpu = pytest.mark.skipif(not _torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def needs_capability(major: int, minor: int, reason: str) -> pytest.MarkDecorator:
    """Skips unless GPU 0 is of compute capability (major, minor) or newer; `reason` says what needs it."""
    ok = _torch.cuda.is_available() and _torch.cuda.get_device_capability() >= (major, minor)
    return pytest.mark.skipif(not ok, reason=reason)

# The longest test files first (seconds on one worker of a 2-core machine, the 120 slowest of
# `--durations`, 2026-12-05; test_fp8.py after its float8 cases shrank):
# under `-n 2 --dist loadfile` (README) a file runs whole on one worker, and a long file taken up
# last leaves the other worker idle at the end; longest first is the classic cure. The order of
# tests inside a file, and of the files not named, is unchanged.
LONGEST_FIRST = {"test_edge.py": 380, "test_slurm.py": 338, "test_checkpoint.py": 337, "test_preemption.py": 191, "test_train_e2e.py": 169,
                 "test_tracking_sync.py": 162, "test_mlflow_server.py": 156, "test_edge_quant.py": 140, "test_llama3.py": 125,
                 "test_edge_sweep.py": 117, "test_fp8.py": 115, "test_kernel_adamw.py": 105, "test_sweeps.py": 104,
                 "test_cluster_postgres.py": 96, "test_multinode.py": 92, "test_edge_shapes.py": 90}


def pytest_configure(config):
    # pytest-xdist's file scheduler sorts the files by their number of tests, most first, unless told
    # not to (xdist 3.8, LoadScopeScheduling.schedule), which undid the order below: test_edge_sweep.py,
    # one test and about 90 s of IREE compiles, ran last and alone in two clean-clone runs of .ci/run,
    # the other worker idle. --no-loadscope-reorder, set here so README's command keeps it.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # a stable sort: each file's own order kept


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


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(backend_store_uri: str, artifacts: Path, port: int | None = None, wait_s: float = 90) -> tuple[subprocess.Popen, str]:
    """A real `mlflow server` on loopback, in its own session (so its workers stop with it), with
    proxied artifacts: clients send and fetch them through the server (`mlflow-artifacts:/`),
    never as paths of their own. Returns once /health answers."""
    import time

    import requests

    port = port or free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", backend_store_uri, "--artifacts-destination", str(artifacts),
    ]
    log = open(artifacts.parent / f"mlflow-server-{port}.log", "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    log.close()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:  # bounded wait for /health
        try:
            if requests.get(f"{url}/health", timeout=1).ok:
                return proc, url
        except requests.RequestException:
            pass
        if proc.poll() is not None:
            break
        time.sleep(0.3)
    stop_server(proc)
    tail = (artifacts.parent / f"mlflow-server-{port}.log").read_text()[-3000:]
    pytest.fail(f"mlflow server ({backend_store_uri}) did not come up in {wait_s:.0f} s:\n{tail}")


def stop_server(proc: subprocess.Popen, sig: int | None = None) -> None:
    """End a server started by start_mlflow_server: its whole session (gunicorn/uvicorn workers too)."""
    import signal

    try:
        os.killpg(proc.pid, signal.SIGTERM if sig is None else sig)
    except ProcessLookupError:
        pass
    proc.wait(timeout=30)


def _postgres_bin() -> Path | None:
    """Debian's PostgreSQL keeps its server programs in /usr/lib/postgresql/VERSION/bin, off PATH."""
    import shutil

    found = shutil.which("initdb")
    if found:
        return Path(found).resolve().parent
    versions = sorted(Path("/usr/lib/postgresql").glob("*/bin/initdb"), key=lambda p: int(p.parent.parent.name) if p.parent.parent.name.isdigit() else 0)
    return versions[-1].parent if versions else None


@pytest.fixture(scope="session")
def postgres_uri():
    """One PostgreSQL server for the session: initdb into a private folder, listening on loopback
    only, on a free port, its socket in that folder; database `mlflow`. Started as the `postgres`
    user when the tests run as root (PostgreSQL refuses to run as root). Yields a SQLAlchemy URI."""
    import shutil
    import tempfile

    bindir = _postgres_bin()
    if bindir is None:
        if os.environ.get("CI") == "true":
            pytest.fail("PostgreSQL is not installed; .ci/run installs it (apt-get install postgresql)")
        pytest.skip("PostgreSQL is not installed (apt-get install postgresql); the team-server tests need it")
    as_user: list[str] = []
    # /tmp, not pytest's tmp_path: the postgres user must be able to reach the folder, and
    # pytest's base folder is root's alone (0700).
    base = Path(tempfile.mkdtemp(prefix="perflab-pg-"))
    if os.getuid() == 0:
        as_user = ["runuser", "-u", "postgres", "--"]
        shutil.chown(base, "postgres", "postgres")
    data, port = base / "data", free_port()

    def pg(*args: str, **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run([*as_user, *args], capture_output=True, text=True, timeout=120, **kwargs)

    done = pg(str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", "--encoding=UTF8", "--no-sync")
    assert done.returncode == 0, done.stdout + done.stderr
    options = f"-c listen_addresses=127.0.0.1 -p {port} -k {base} -c fsync=off -c full_page_writes=off"
    done = pg(str(bindir / "pg_ctl"), "-D", str(data), "-o", options, "-l", str(base / "postgres.log"), "-w", "-t", "60", "start")
    assert done.returncode == 0, done.stdout + done.stderr + (base / "postgres.log").read_text()
    try:
        done = pg(str(bindir / "createdb"), "-h", "127.0.0.1", "-p", str(port), "-U", "postgres", "mlflow")
        assert done.returncode == 0, done.stdout + done.stderr
        yield f"postgresql://postgres@127.0.0.1:{port}/mlflow"
    finally:
        pg(str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop")
        shutil.rmtree(base, ignore_errors=True)


@pytest.fixture(scope="session")
def slurm_cluster():
    """One real SLURM cluster for the session, this machine its one node: munged, slurmctld, slurmd
    and slurmdbd (on a MariaDB of its own), private to the session (tests/support/slurm.py).
    Yields a SlurmCluster; its `env` (SLURM_CONF) points sbatch and the other clients at it.
    Skipped only where the programs are missing: installed but broken, the tests fail."""
    from tests.support.slurm import missing_binaries, running_cluster

    missing = missing_binaries()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM is not installed ({', '.join(missing)} missing); .ci/run installs it (apt-get install slurm-wlm munge slurmdbd mariadb-server)")
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing; apt-get install slurm-wlm munge slurmdbd mariadb-server); the SLURM tests need it")
    with running_cluster() as cluster:
        yield cluster


def train_on_and_off(tmp_path: Path, overrides: list[str], knob: str) -> dict[str, tuple[dict, list[dict]]]:
    """The same run in this process (train(), as a rank runs it) with `knob`=on and then =off: for each,
    its summary.json and its metrics.jsonl's lines. Tests that call it take the in_process_runs fixture."""
    from src.config.compose import compose_config
    from src.runtime import RunContext
    from src.train.worker import train

    runs = {}
    for use in ("on", "off"):
        run_dir = tmp_path / use
        run_dir.mkdir()
        train(compose_config([*overrides, f"{knob}={use}"]), RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
        runs[use] = (json.loads((run_dir / "summary.json").read_text()),
                     [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    return runs


@pytest.fixture
def in_process_runs():
    """train() sets up a rank's logging (handlers on the root logger) and Dynamo keeps what it
    compiled: both are put back after the test, for the tests that share this process."""
    import logging

    import torch

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    root.__dict__.pop("_perflab_configured", None)
    torch._dynamo.reset()
