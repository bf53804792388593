"""A real `mlflow server` on a free loopback port: a run logs to it and is read back through the REST
API, a parallel sweep logs its parent and children to it. (With the server down, the run completes
and keeps its metrics on disk: tests/system/test_tracking_sync.py, where the sync then stores it.)"""
from __future__ import annotations

from pathlib import Path

import pytest
import requests

from tests.support.cli import read_summary, run_cli
from tests.support.servers import free_port, start_mlflow_server, stop_server

RUN = ["dist.nproc=1", "sharding=none", "train.steps=4", "tracking.system_metrics=false", "tracking.connect_timeout_s=2"]


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory, mlflow_store_template):
    """One server for the file's two tests (a start is 7-8 s of CPU): each reads only its own runs."""
    base = tmp_path_factory.mktemp("mlflow_server")
    proc, url = start_mlflow_server(f"sqlite:///{base / 'server.db'}", base / "artifacts", seed=mlflow_store_template)
    yield url
    stop_server(proc)


def test_a_run_logs_to_a_tracking_server(tmp_path: Path, mlflow_server: str):
    work = tmp_path / "work"
    work.mkdir()
    proc = run_cli([*RUN, f"tracking.uri={mlflow_server}"], cwd=work)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    run_id = read_summary(work)["mlflow_run_id"]
    run = requests.get(f"{mlflow_server}/api/2.0/mlflow/runs/get", params={"run_id": run_id}, timeout=10).json()["run"]
    assert run["info"]["status"] == "FINISHED"
    params = {p["key"]: p["value"] for p in run["data"]["params"]}
    assert params["model.name"] == "tiny" and params["sharding.name"] == "none"
    history = requests.get(f"{mlflow_server}/api/2.0/mlflow/metrics/get-history", params={"run_id": run_id, "metric_key": "loss"}, timeout=10).json()
    assert sorted(m["step"] for m in history["metrics"]) == [0, 1, 2, 3]
    files = requests.get(f"{mlflow_server}/api/2.0/mlflow/artifacts/list", params={"run_id": run_id}, timeout=10).json()["files"]
    assert {"summary.json", "config.yaml", "curves.png", "metrics.jsonl"} <= {f["path"] for f in files}


def test_a_parallel_joblib_sweep_logs_parent_and_children_to_the_server(tmp_path: Path, mlflow_server: str):
    """README's parallel sweep as written: two jobs at once in joblib (loky) workers, each starting
    2 gloo ranks from inside its worker (which once died: "cannot find context for 'loky'")."""
    work = tmp_path / "work"
    work.mkdir()
    args = ["-m", "hydra/launcher=joblib", "precision=fp32,bf16", f"tracking.uri={mlflow_server}", "train.steps=2", "tracking.system_metrics=false"]
    proc = run_cli(args, cwd=work, timeout=400)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    from mlflow import MlflowClient

    client = MlflowClient(mlflow_server)
    exp = client.get_experiment_by_name("perflab")  # a named experiment, not MLflow's Default
    runs = client.search_runs([exp.experiment_id])
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    children = {r.info.run_name: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert set(children) == {"fp32", "bf16"}  # what varies, no tracking.uri
    assert all(c.info.status == "FINISHED" and c.data.params["dist.nproc"] == "2" for c in children.values())
    assert parent.info.run_name == "sweep precision=fp32,bf16 train.steps=2"
    assert parent.data.params["precision.name"] == "fp32,bf16"
    best = max(children.values(), key=lambda c: c.data.metrics["summary.tokens_per_s_per_device"])
    assert parent.data.metrics["summary.tokens_per_s_per_device"] == best.data.metrics["summary.tokens_per_s_per_device"]
    assert parent.data.tags["best_job"].startswith(best.info.run_name)


def test_a_call_to_a_server_still_down_after_the_retry_window_is_skipped_with_one_warning(caplog):
    """The store stops answering and does not come back within tracking.retry_s: the call is given up
    (None), the rest of the record is skipped, one warning names the first error. (It raised
    UnboundLocalError before: the error was bound only when the retry itself ran and failed.)"""
    import logging

    from src.tracking.mlflow_run import MlflowTracker

    down = f"http://127.0.0.1:{free_port()}"
    tracker = MlflowTracker(down, "e", "r", {}, {}, None, metric_writer=False, retry_s=0.2)

    def refused():
        raise ConnectionError("connection refused")

    with caplog.at_level(logging.WARNING):
        assert tracker._server_call("the summary metrics", refused) is None
        assert tracker._server_call("the run's end", refused) is None  # skipped, no second warning
    warnings = [r.getMessage() for r in caplog.records if "did not take" in r.getMessage()]
    assert len(warnings) == 1 and "the summary metrics (ConnectionError: connection refused)" in warnings[0] and tracker.server_lost
