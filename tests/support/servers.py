"""Plugin: servers the system tests start for real, on loopback: `mlflow server` (start_mlflow_server,
stop_server) and, for the session, a private PostgreSQL (the `postgres_uri` fixture)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# MLflow 3's server also starts a job runner and seven Huey consumers (its GenAI jobs: nothing this
# project calls), each importing MLflow: about 20 s of CPU a start on a 2-core machine, and /health
# answers in half the time without them. The tracking API the tests use is the same either way.
SERVER_ENV = {"MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_mlflow_server(backend_store_uri: str, artifacts: Path, port: int | None = None, wait_s: float = 90,
                        seed: Path | None = None) -> tuple[subprocess.Popen, str]:
    """A real `mlflow server` on loopback, in its own session (so its workers stop with it), with
    proxied artifacts: clients send and fetch them through the server (`mlflow-artifacts:/`),
    never as paths of their own. Returns once /health answers. `seed`: a made SQLite store
    (tests/support/cli.py mlflow_store_template) copied to a sqlite backend first, so that the
    server's start skips making the tables (about 1 s of CPU)."""
    import shutil
    import time

    import requests

    if seed is not None:
        assert backend_store_uri.startswith("sqlite:///"), backend_store_uri
        shutil.copyfile(seed, backend_store_uri[len("sqlite:///"):])
    port = port or free_port()
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
        "--backend-store-uri", backend_store_uri, "--artifacts-destination", str(artifacts),
    ]
    log = open(artifacts.parent / f"mlflow-server-{port}.log", "a")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **SERVER_ENV})
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
