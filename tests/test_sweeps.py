"""Hydra multiruns as MLflow parent/child runs, failures inside a sweep, and src.compare."""
from __future__ import annotations

import csv
from pathlib import Path

import pytest
from mlflow import MlflowClient

from src.compare import main as compare_main
from tests.conftest import run_cli

FAST = ["dist.nproc=1", "train.steps=2", "tracking.system_metrics=false"]  # one in-process rank per job


def _runs(cwd: Path):
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("sweep")
    proc = run_cli(["-m", "precision=fp32,bf16", "sharding=none,fsdp2", *FAST], cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd


def test_a_2x2_sweep_is_one_parent_with_four_finished_children(sweep: Path):
    client, runs = _runs(sweep)
    parents = [r for r in runs if r.data.tags.get("sweep") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4 and len(runs) == 5
    assert all(c.info.status == "FINISHED" for c in children)
    combos = {(c.data.params["precision.name"], c.data.params["sharding.name"]) for c in children}
    assert combos == {("fp32", "none"), ("fp32", "fsdp2"), ("bf16", "none"), ("bf16", "fsdp2")}
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs"] == "4 finished, 0 failed"
    assert parent.data.metrics["jobs_finished"] == 4 and parent.data.metrics["jobs_failed"] == 0
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"sweep.csv", "sweep.png"}
    # sweep output lands in multirun/, one directory per job
    (sweep_dir,) = list(sweep.glob("multirun/*/*"))
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [r["status"] for r in rows] == ["finished"] * 4 and all(float(r["tokens_per_s_per_device"]) > 0 for r in rows)


def test_compare_prints_the_sweep_with_the_best_run_marked(sweep: Path, capsys, monkeypatch):
    monkeypatch.chdir(sweep)
    assert compare_main(["--sweep", "latest", "--metric", "tokens_per_s_per_device", "--width", "250"]) == 0
    out = capsys.readouterr().out
    assert "4 runs by tokens_per_s_per_device (higher is better)" in out
    lines = [line for line in out.splitlines() if "precision=" in line]
    assert len(lines) == 4 and "★" in lines[0] and sum("★" in line for line in lines) == 1
    for combo in ("precision=fp32 sharding=none", "precision=bf16 sharding=fsdp2"):
        assert any(combo in line for line in lines)
    # the same table from the run directories alone, no tracking store
    assert compare_main(["--dirs", "multirun", "--metric", "final_loss", "--width", "250"]) == 0
    assert "4 runs by final_loss (lower is better)" in capsys.readouterr().out


def test_a_failing_job_is_failed_and_the_sweep_goes_on(workdir: Path):
    proc = run_cli(["-m", "fault.kind=raise,none", "fault.rank=0", "fault.step=1", *FAST], cwd=workdir, timeout=300)
    assert proc.returncode == 1  # the sweep finished, and says a job failed
    assert "job 0 (fault.kind=raise" in proc.stdout + proc.stderr
    client, runs = _runs(workdir)
    parent = next(r for r in runs if r.data.tags.get("sweep") == "true")
    children = {r.data.params["fault.kind"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert children["raise"].info.status == "FAILED" and "injected fault at step 1" in children["raise"].data.tags["error"]
    assert children["none"].info.status == "FINISHED"
    assert parent.data.tags["jobs"] == "1 finished, 1 failed" and parent.info.status == "FINISHED"


def test_parallel_sweeps_on_sqlite_are_refused_before_they_start(workdir: Path):
    proc = run_cli(["-m", "hydra/launcher=joblib", "precision=fp32,bf16"], cwd=workdir, timeout=120)
    assert proc.returncode == 2
    assert "takes one writer at a time" in proc.stderr and "tracking.uri=http://127.0.0.1:5000" in proc.stderr
    assert list(workdir.iterdir()) == []
