"""Sweeps through a real SLURM: `-m hydra/launcher=submitit_slurm` submits with the real sbatch to
the session's slurmctld (tests/slurm_cluster.py, this machine its one node), srun starts each job's
task, and the jobs log to an `mlflow server` that the node reaches by this machine's name."""
from __future__ import annotations

import json
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from tests.conftest import free_port, run_cli, stop_server
from tests.slurm_cluster import SlurmCluster
from tests.test_cluster_postgres import FAST


class ClusterTracking:
    """An `mlflow server` as a cluster's nodes reach one: by the submitting machine's name (the
    launcher refuses a loopback URI under SLURM), listening on the address that name resolves to.
    SQLite behind it: the server is its one writer, whatever number of jobs log at once."""

    def __init__(self, hostname: str, base: Path):
        port = free_port()
        self.url = f"http://{hostname}:{port}"
        cmd = [
            sys.executable, "-m", "mlflow", "server", "--host", socket.gethostbyname(hostname), "--port", str(port), "--workers", "1",
            "--backend-store-uri", f"sqlite:///{base / 'mlflow.db'}", "--artifacts-destination", str(base / "artifacts"),
            # MLflow 3 answers only localhost and IP addresses in the Host header unless told
            "--allowed-hosts", f"{hostname},{hostname}:{port}",
        ]
        self.log = base / "mlflow-server.log"
        with open(self.log, "w") as out:
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                if requests.get(f"{self.url}/health", timeout=1).ok:
                    return
            except requests.RequestException:
                pass
            if self.proc.poll() is not None:
                break
            time.sleep(0.3)
        stop_server(self.proc)
        pytest.fail(f"mlflow server at {self.url} did not come up:\n{self.log.read_text()[-3000:]}")

    def runs(self, experiment: str):
        client = MlflowClient(self.url)
        return client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


@pytest.fixture(scope="module")
def tracking(slurm_cluster: SlurmCluster, tmp_path_factory):
    server = ClusterTracking(slurm_cluster.hostname, tmp_path_factory.mktemp("tracking"))
    yield server
    stop_server(server.proc)


def _launcher(cluster: SlurmCluster, timeout_min: int = 10) -> list[str]:
    """What a sweep on this cluster passes: its partition, and a job of one CPU (a node of two runs
    both jobs of a sweep at once) and 2 GB."""
    return ["-m", "hydra/launcher=submitit_slurm", f"hydra.launcher.partition={cluster.partition}", f"hydra.launcher.timeout_min={timeout_min}",
            "hydra.launcher.cpus_per_task=1", "hydra.launcher.mem_gb=2"]


def _slurm_time(value: str) -> datetime:
    return datetime.fromisoformat(value)


def test_a_two_job_sweep_through_sbatch_is_one_parent_run_with_two_finished_children(tmp_path: Path, slurm_cluster: SlurmCluster,
                                                                                       tracking: ClusterTracking):
    """The submitting command waits for both array jobs; SLURM ran them (at once, a CPU each, and
    completed them with exit code 0), and MLflow has the sweep's parent and one FINISHED child per
    job, each matching its job folder's summary.json."""
    args = [*_launcher(slurm_cluster), "train.seed=1,2", *FAST, f"tracking.uri={tracking.url}", "tracking.experiment=slurm-sweep"]
    proc = run_cli(args, cwd=tmp_path, timeout=300, env=slurm_cluster.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + slurm_cluster.logs()
    (sweep_dir,) = tmp_path.glob("multirun/*/*")

    # the sbatch script submitit wrote, as SLURM took it
    (script,) = sweep_dir.glob(".submitit/*/*_submission.sh")
    flags = {line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")}
    assert {f"--partition={slurm_cluster.partition}", "--time=10", "--cpus-per-task=1", "--mem=2GB", "--nodes=1", "--ntasks-per-node=1",
            "--array=0-1%2"} <= flags
    assert not any(flag.startswith(("--gpus", "--gres")) for flag in flags)  # backend=cpu asks for no GPU
    array_id = script.parent.name
    jobs = {task: slurm_cluster.job(f"{array_id}_{task}") for task in (0, 1)}
    for task, job in jobs.items():
        assert job.get("JobState") == "COMPLETED" and job["ExitCode"] == "0:0", (task, job)
        assert job["Partition"] == slurm_cluster.partition and job["NodeList"] == slurm_cluster.hostname and job["NumCPUs"] == "1"
        assert (sweep_dir / ".submitit" / f"{array_id}_{task}" / f"{array_id}_{task}_0_result.pkl").exists()
    starts = [_slurm_time(job["StartTime"]) for job in jobs.values()]
    ends = [_slurm_time(job["EndTime"]) for job in jobs.values()]
    assert max(starts) <= min(ends)  # the two jobs ran at once, a CPU each

    runs = tracking.runs("slurm-sweep")
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    children = {r.data.params["train.seed"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert sorted(children) == ["1", "2"] and len(runs) == 3
    assert all(child.info.status == "FINISHED" for child in children.values())
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs"] == "2 finished, 0 failed"
    for job_dir in (sweep_dir / "0", sweep_dir / "1"):
        summary = json.loads((job_dir / "summary.json").read_text())
        assert summary["status"] == "finished" and summary["steps"] == 2
        run = next(r for r in children.values() if r.info.run_id == summary["mlflow_run_id"])
        assert run.data.metrics["summary.final_loss"] == pytest.approx(summary["final_loss"])
