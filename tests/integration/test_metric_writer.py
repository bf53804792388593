"""The metric writer process (src/tracking/writer.py) started before its run exists: it imports MLflow
and opens the store while rank 0 does, learns the run id, and stores every step; one whose run never
opened ends without storing anything and leaves no process behind. Real SQLite stores."""
from __future__ import annotations

import psutil
import pytest
from mlflow import MlflowClient

from src.tracking.mlflow_run import MlflowTracker
from src.tracking.writer import MetricWriter


def _writers() -> list[psutil.Process]:
    return [p for p in psutil.Process().children(recursive=True) if "src.tracking.writer" in " ".join(p.cmdline())]


def test_a_writer_started_before_its_run_stores_every_step_once_told_the_run(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    writer = MetricWriter(uri)  # imports MLflow now, opens the store once it has the run id
    client = MlflowClient(uri)
    run_id = client.create_run(client.create_experiment("w")).info.run_id
    writer.begin(run_id)
    for step in range(5):
        writer.log(step, {"loss": 5.0 - step, "skipped": None})
    assert writer.close() and writer.process.returncode == 0
    history = client.get_metric_history(run_id, "loss")
    assert [(m.step, m.value) for m in history] == [(s, 5.0 - s) for s in range(5)]
    assert "skipped" not in client.get_run(run_id).data.metrics


def test_a_writer_whose_run_never_opened_ends_storing_nothing(tmp_path):
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    writer = MetricWriter(uri)
    assert writer.close(timeout_s=30) and writer.process.returncode == 0 and not _writers()
    client = MlflowClient(uri)
    assert [r for e in client.search_experiments() for r in client.search_runs([e.experiment_id])] == []


def test_a_tracker_that_cannot_open_its_run_stops_the_writer_it_started(tmp_path):
    """An elastic restart's run id that the store does not hold: start() raises MLflow's error, and
    the writer it had started side by side is gone with it."""
    uri = f"sqlite:///{tmp_path / 'mlflow.db'}"
    tracker = MlflowTracker(uri, "e", "n", {}, {}, None, continue_run_id="0" * 32)
    with pytest.raises(Exception, match="0" * 32):
        tracker.start()
    assert tracker.writer is None and not _writers()
