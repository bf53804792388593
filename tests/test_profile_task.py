"""task=profile on CPU ranks and task=diagnose without a GPU, through the real command line."""
from __future__ import annotations

import json
from pathlib import Path

from tests.conftest import read_summary, run_cli
from tests.test_diagnosis import FIXTURES


def test_profile_on_cpu_writes_traces_table_and_breakdown(workdir: Path):
    proc = run_cli(["+exp=profile", "tracking=none"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = list(workdir.glob("outputs/*/*"))
    profile = run_dir / "profile"
    for rank in (0, 1):  # one Chrome/Perfetto trace per rank
        trace = json.loads((profile / f"trace_rank{rank}.json").read_text())
        names = {e.get("name", "") for e in trace["traceEvents"]}
        assert "aten::mm" in names and any(n.startswith("ProfilerStep#") for n in names)
    table = (profile / "key_averages.txt").read_text()
    assert "aten::mm" in table and "Self CPU" in table
    breakdown = json.loads((profile / "breakdown.json").read_text())
    assert breakdown["profiled_steps"] == 3
    assert {"gemm", "attention", "communication", "optimizer"} <= set(breakdown["breakdown_share"])
    assert abs(sum(breakdown["breakdown_share"].values()) - 1) < 1e-6
    summary = read_summary(workdir)
    assert summary["task"] == "profile" and summary["profile"]["breakdown_s"]["gemm"] > 0


def test_profile_schedule_longer_than_the_run_is_refused(workdir: Path):
    proc = run_cli(["+exp=profile", "train.steps=3"], cwd=workdir, timeout=120)
    assert proc.returncode == 2 and "shorter than the profiler schedule" in proc.stderr


def test_diagnose_without_a_gpu_says_so_and_points_elsewhere(workdir: Path):
    proc = run_cli(["+exp=diagnose"], cwd=workdir, timeout=120)
    assert proc.returncode == 2
    assert "needs an NVIDIA GPU" in proc.stderr and "python -m src.diagnose REPORT" in proc.stderr and "+exp=profile" in proc.stderr
    assert list(workdir.iterdir()) == []


def test_diagnose_an_existing_report_through_the_run(workdir: Path):
    proc = run_cli(["+exp=diagnose", f"diagnose.report={FIXTURES / 'h200_ops_raw.csv'}"], cwd=workdir, timeout=180)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(workdir)
    assert summary["task"] == "diagnose" and summary["kernel_count"] == 6
    assert summary["fusable"] == ["rms_norm", "softmax", "swiglu"]
    from mlflow import MlflowClient

    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run = client.get_run(summary["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.data.metrics["summary.share_memory_bound"] > 0.1
    assert {a.path for a in client.list_artifacts(run.info.run_id, "diagnose")} == {"diagnose/diagnosis.json", "diagnose/roofline.png", "diagnose/top_ops.md"}
