"""A team's MLflow: `mlflow server` on PostgreSQL with proxied artifacts, fed by sweeps that
Hydra's submitit launcher runs through submitit's real local executor (each job a process, watched
as on SLURM), and a server that dies mid-run. One PostgreSQL for the session (tests/support/servers.py),
one server for this module."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient
from mlflow.artifacts import download_artifacts

from src.config.compose import ConfigError, compose_config
from src.run import preflight
from tests.support.cli import REPO, run_cli
from tests.support.servers import start_mlflow_server, stop_server

FAST = ["dist.nproc=1", "data=random", "train.steps=2", "tracking.system_metrics=false"]


class TeamServer:
    """The module's server; `kill` and `start` for the outage test (same port, same database)."""

    def __init__(self, backend: str, artifacts: Path):
        self.backend, self.artifacts = backend, artifacts
        self.proc, self.url = start_mlflow_server(backend, artifacts)
        self.port = int(self.url.rsplit(":", 1)[1])

    def kill(self) -> None:
        stop_server(self.proc, signal.SIGKILL)

    def start(self) -> None:
        self.proc, _ = start_mlflow_server(self.backend, self.artifacts, port=self.port)


@pytest.fixture(scope="module")
def team_server(postgres_uri: str, tmp_path_factory):
    server = TeamServer(postgres_uri, tmp_path_factory.mktemp("server") / "artifacts")
    yield server
    stop_server(server.proc, signal.SIGKILL)  # nothing to finish: PostgreSQL holds what it stored


def _experiment_runs(url: str, name: str):
    client = MlflowClient(url)
    return client, client.search_runs([client.get_experiment_by_name(name).experiment_id])


def test_a_submitit_local_sweep_on_the_postgres_server_finishes_its_jobs_and_records_a_dead_one(tmp_path: Path, team_server: TeamServer):
    """Two jobs in parallel, each a submitit job; the `kill` one SIGKILLs its own process at step 0,
    as a scheduler's time limit or the OOM killer would: recorded FAILED, and the sweep goes on.
    (Two jobs, not a 2x2 grid: tests/integration/test_sweeps.py covers grids, and four jobs' start-ups on two
    cores made this the suite's slowest test, 140 s.)"""
    work = tmp_path / "work"
    work.mkdir()
    args = ["-m", "hydra/launcher=submitit_local", "precision=fp32", "fault.kind=none,kill", "fault.step=0", *FAST,
            f"tracking.uri={team_server.url}", "tracking.experiment=submitit"]
    proc = run_cli(args, cwd=work, timeout=400)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # the sweep ended, and says jobs failed
    client, runs = _experiment_runs(team_server.url, "submitit")
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    children = {r.data.params["fault.kind"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert len(children) == 2 and len(runs) == 3
    finished, dead = children["none"], children["kill"]
    assert finished.info.status == "FINISHED" and finished.info.run_name == "fault.kind=none"
    assert dead.info.status == "FAILED" and "died without a result" in dead.data.tags["error"]
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs"] == "1 finished, 1 failed"
    (sweep_dir,) = work.glob("multirun/*/*")
    assert sorted(p.name for p in sweep_dir.iterdir() if p.name.isdigit()) == ["0", "1"]
    assert any(sweep_dir.glob(".submitit/*/*_submitted.pkl"))  # submitit ran the jobs
    # proxied artifacts: stored through the server in its own folder, fetched back through it
    run = finished
    assert run.info.artifact_uri.startswith("mlflow-artifacts:/")
    job_dir = next(d for d in sweep_dir.iterdir() if (d / "summary.json").exists() and json.loads((d / "summary.json").read_text()).get("mlflow_run_id") == run.info.run_id)
    fetched = download_artifacts(run_id=run.info.run_id, artifact_path="summary.json", tracking_uri=team_server.url, dst_path=str(tmp_path / "back"))
    assert json.loads(Path(fetched).read_text()) == json.loads((job_dir / "summary.json").read_text())
    assert {"config.yaml", "metrics.jsonl", "curves.png", "run.log"} <= {a.path for a in client.list_artifacts(run.info.run_id)}
    assert list(team_server.artifacts.rglob(f"{run.info.run_id}/artifacts/summary.json"))  # on the server's side
    assert not (work / "mlartifacts").exists() and not (work / "mlruns").exists()  # nothing as a client-side path
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"sweep.csv", "sweep.png"}
    assert "died without a result" in (sweep_dir / "1" / "summary.json").read_text()  # the dead job's own record


def test_a_postgres_backed_server_that_dies_mid_run_loses_no_metric(tmp_path: Path, team_server: TeamServer):
    """The server is SIGKILLed once the run has logged a step, and started again once the writer has
    said it did not take the metrics (however long its start takes: a server that came back before
    the writer first sent would test nothing): the writer retries with backoff until it answers, and
    MLflow ends up with every step metrics.jsonl has."""
    import threading

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, "-m", "src.run", "dist.nproc=1", "sharding=none", "data=random", "train.steps=12", "tracking.system_metrics=false",
           f"tracking.uri={team_server.url}", "tracking.experiment=outage"]
    run = subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    err_lines: list[str] = []
    refused = threading.Event()

    def read_stderr() -> None:  # the writer's warnings come on the run's stderr
        for line in run.stderr:
            err_lines.append(line)
            if "did not take step metrics" in line:
                refused.set()

    reader = threading.Thread(target=read_stderr, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline and not any(p.read_text().strip() for p in tmp_path.glob("outputs/*/*/metrics.jsonl")):
            time.sleep(0.1)
        assert run.poll() is None, "the run ended before a step was logged"
        team_server.kill()
        with pytest.raises(requests.ConnectionError):
            requests.get(f"{team_server.url}/health", timeout=2)
        refused.wait(timeout=120)
        team_server.start()
        out = run.stdout.read()
        run.wait(timeout=240)
        reader.join(timeout=60)
        err = "".join(err_lines)
    finally:
        if run.poll() is None:
            run.kill()
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    console = out + err
    assert "did not take step metrics" in console and "answers again" in console  # the writer retried, and got through
    (metrics,) = tmp_path.glob("outputs/*/*/metrics.jsonl")
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == list(range(12))
    summary = json.loads((metrics.parent / "summary.json").read_text())
    client = MlflowClient(team_server.url)
    mlflow_run = client.get_run(summary["mlflow_run_id"])
    assert mlflow_run.info.status == "FINISHED"
    assert sorted(m.step for m in client.get_metric_history(mlflow_run.info.run_id, "loss")) == steps  # every step, once
    assert "summary.tokens_per_s_per_device" in mlflow_run.data.metrics
    assert "summary.json" in {a.path for a in client.list_artifacts(mlflow_run.info.run_id)}


@pytest.mark.parametrize("overrides,message", [
    (["hydra/launcher=submitit_local", "precision=fp32,bf16"], r"^hydra/launcher=submitit_local runs jobs in parallel, but tracking.uri=sqlite:///mlflow.db"),
    (["hydra/launcher=submitit_slurm", "tracking.uri=http://127.0.0.1:5000", "precision=fp32,bf16"], r"^tracking.uri=http://127.0.0.1:5000 is this machine's loopback"),
    (["hydra/launcher=submitit_slurm", "tracking=none", "hydra.launcher.tasks_per_node=4"], r"^hydra.launcher.tasks_per_node=4: perflab runs one task per node"),
    (["hydra/launcher=submitit_local", "tracking=none", "dist.nnodes=2"], r"^dist.nnodes=2 but hydra.launcher.nodes=1 .*local executor runs one node"),
    (["hydra/launcher=submitit_slurm", "tracking=none", "backend=cuda", "dist.nproc=4,8"], r"^dist.nproc=4 but hydra.launcher.gpus_per_node=2 \(the sweep's dist.nproc, without what it varies\)"),
    (["hydra/launcher=submitit_slurm", "tracking=none", "backend=cuda", "dist.nnodes=2", "dist.fake=false,true"],
     r"^dist.fake=true runs rank 0 alone on one node, but hydra.launcher.nodes=2 .*sweep dist.fake in separate commands"),
])
def test_cluster_launcher_settings_that_cannot_run_are_refused_in_one_line(overrides: list[str], message: str, tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=message) as err:
        preflight(overrides, multirun=True)
    assert "\n" not in str(err.value)
    assert list(tmp_path.iterdir()) == []  # nothing submitted, no folder made


@pytest.mark.parametrize("fake,nodes,gpus", [("false", 2, 8), ("true", 1, 1)])
def test_a_faked_group_queues_for_one_node_and_one_gpu(fake: str, nodes: int, gpus: int):
    """dist.fake runs rank 0 of 2 x 8 alone in one process: SLURM is asked for that, not for the group it fakes."""
    launcher = compose_config(["hydra/launcher=submitit_slurm", "backend=cuda", "dist.nnodes=2", "dist.nproc=8", f"dist.fake={fake}"],
                              with_hydra=True).hydra.launcher
    assert (launcher.nodes, launcher.gpus_per_node, launcher.tasks_per_node) == (nodes, gpus, 1)
    local = compose_config(["hydra/launcher=submitit_local", "backend=cuda", "dist.nproc=8", f"dist.fake={fake}"], with_hydra=True).hydra.launcher
    assert local.gpus_per_node == (1 if fake == "true" else 8)
    assert compose_config(["hydra/launcher=submitit_slurm", "backend=cpu", f"dist.fake={fake}"], with_hydra=True).hydra.launcher.gpus_per_node is None


def test_a_faked_job_of_two_nodes_passes_the_local_executor(tmp_path: Path, monkeypatch):
    """submitit's local executor runs one node: enough for dist.fake's rank 0 of a 2-node group."""
    monkeypatch.chdir(tmp_path)
    preflight(["hydra/launcher=submitit_local", "tracking=none", "dist.nnodes=2", "dist.nproc=2", "dist.fake=true"], multirun=True)
    assert list(tmp_path.iterdir()) == []  # a check: nothing submitted
