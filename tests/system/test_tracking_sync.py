"""A real `mlflow server` that is down when a run ends, or when it starts: the run still ends with
its own status and exit code, says once how to store the rest, and `python -m src.tracking.sync
RUN_DIR` stores it (every step once, the run ended as it ended) once the server is back."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from mlflow import MlflowClient

from tests.support.cli import REPO, run_cli
from tests.support.servers import free_port, start_mlflow_server, stop_server

STEPS = 80
# tracking.retry_s=2: how long the run waits for a server that went away, kept short for the test
RUN = ["dist.nproc=1", "sharding=none", f"train.steps={STEPS}", "tracking.system_metrics=false", "tracking.retry_s=2",
       "tracking.connect_timeout_s=2", "hydra.run.dir=run"]


def _sync(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return run_cli([*args], cwd=cwd, module="src.tracking.sync")


def test_a_server_down_at_the_end_loses_nothing_and_the_sync_finishes_the_run(tmp_path: Path, mlflow_store_template: Path):
    store, artifacts, port = f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts", free_port()
    server, url = start_mlflow_server(store, artifacts, port, seed=mlflow_store_template)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-m", "src.run", *RUN, f"tracking.uri={url}"], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    metrics = tmp_path / "run" / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while not metrics.exists() or len(metrics.read_text().splitlines()) < 5:
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "no step in 120 s"
        time.sleep(0.05)
    stop_server(server, signal.SIGKILL)  # gone mid-run, and still gone when the run ends
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    run_dir = tmp_path / "run"
    warnings = [line for line in out.splitlines() if "src.tracking.sync" in line]
    assert len(warnings) == 1 and f"python -m src.tracking.sync {run_dir}" in warnings[0], out
    assert "Traceback" not in out
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == STEPS
    assert len(metrics.read_text().splitlines()) == STEPS
    run_id = summary["mlflow_run_id"]
    assert MlflowClient(store).get_run(run_id).info.status == "RUNNING"  # the store never heard the end

    proc = _sync(tmp_path, str(run_dir))  # the server still down: nothing changes, one line
    assert proc.returncode == 1 and proc.stderr.startswith(f"error: {run_dir}: MLflow at {url} did not take the run"), proc.stderr
    assert (run_dir / ".mlflow_unsynced.json").exists()

    server, _ = start_mlflow_server(store, artifacts, port)
    try:
        proc = _sync(tmp_path, str(run_dir))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert f"run {run_id[:8]} ended FINISHED" in proc.stdout
        client = MlflowClient(url)
        run = client.get_run(run_id)
        assert run.info.status == "FINISHED"
        assert sorted(m.step for m in client.get_metric_history(run_id, "loss")) == list(range(STEPS))  # each step once
        assert run.data.metrics["summary.final_loss"] == summary["final_loss"]
        assert {"summary.json", "metrics.jsonl", "curves.png"} <= {f.path for f in client.list_artifacts(run_id)}
        assert not (run_dir / ".mlflow_unsynced.json").exists()
        again = _sync(tmp_path, str(run_dir))
        assert again.returncode == 0 and "nothing to store" in again.stdout
    finally:
        stop_server(server)


def test_a_server_down_from_the_start_is_made_by_the_sync(tmp_path: Path, mlflow_store_template: Path):
    """The run completes untracked, saying so once, its figures and every step's metrics in its
    folder; the sync makes its MLflow run once the server is up."""
    store, artifacts, port = f"sqlite:///{tmp_path / 'server.db'}", tmp_path / "artifacts", free_port()
    url = f"http://127.0.0.1:{port}"  # nothing listens yet
    proc = run_cli([*RUN, "train.steps=4", f"tracking.uri={url}", "tracking.experiment=later"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_dir = tmp_path / "run"
    out = proc.stdout + proc.stderr
    assert f"python -m src.tracking.sync {run_dir}" in out and out.count(f"MLflow server at {url} did not answer") == 1
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["mlflow_run_id"] is None
    lines = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [0, 1, 2, 3] and all(m["loss"] > 0 for m in lines)
    server, _ = start_mlflow_server(store, artifacts, port, seed=mlflow_store_template)
    try:
        proc = _sync(tmp_path, str(run_dir))
        assert proc.returncode == 0, proc.stdout + proc.stderr
        client = MlflowClient(url)
        (run,) = client.search_runs([client.get_experiment_by_name("later").experiment_id])
        assert run.info.status == "FINISHED" and run.data.params["train.steps"] == "4"
        assert run.data.tags["speed.recipes"]  # the tags the run set while the store was away
        assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]
        assert (run_dir / ".mlflow_run_id").read_text() == run.info.run_id
    finally:
        stop_server(server)


def test_the_sync_answers_a_folder_that_is_no_run_in_one_line_with_exit_2(tmp_path: Path, capsys):
    from src.tracking.sync import UNSYNCED_FILE, main

    empty, cut = tmp_path / "empty", tmp_path / "cut"
    empty.mkdir()
    cut.mkdir()
    (cut / "summary.json").write_text("{}")
    (cut / UNSYNCED_FILE).write_text('{"uri": "sqlite:///mlflow.d')  # cut off mid-write
    for folder, said in ((tmp_path / "missing", "no such run directory"), (empty, "not a run's folder"), (cut, "cut off or not this project's")):
        assert main([str(folder)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {folder}") and said in err and len(err.strip().splitlines()) == 1, err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut", "empty"]  # no store made
