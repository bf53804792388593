"""Sweeps through a real SLURM: `-m hydra/launcher=submitit_slurm` submits with the real sbatch to
the session's slurmctld (tests/support/slurm.py, this machine its one node), srun starts each job's
task, and the jobs log to an `mlflow server` that the node reaches by this machine's name. A job
that dies, one stopped by `scancel --signal`, and one at its time limit, requeued by submitit."""
from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime
from pathlib import Path

import pytest
import requests
from mlflow import MlflowClient

from tests.support.cli import REPO, run_cli
from tests.support.servers import SERVER_ENV, free_port, stop_server
from tests.support.slurm import SlurmCluster
from tests.system.test_cluster_postgres import FAST


class ClusterTracking:
    """An `mlflow server` as a cluster's nodes reach one: by the submitting machine's name (the
    launcher refuses a loopback URI under SLURM), listening on the address that name resolves to.
    SQLite behind it: the server is its one writer, whatever number of jobs log at once."""

    def __init__(self, hostname: str, base: Path, seed: Path):
        shutil.copyfile(seed, base / "mlflow.db")  # a made store: the server's start skips making its tables
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
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env={**os.environ, **SERVER_ENV})
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
def tracking(slurm_cluster: SlurmCluster, tmp_path_factory, mlflow_store_template):
    server = ClusterTracking(slurm_cluster.hostname, tmp_path_factory.mktemp("tracking"), mlflow_store_template)
    yield server
    stop_server(server.proc)


def _launcher(cluster: SlurmCluster, timeout_min: int = 10) -> list[str]:
    """What a sweep on this cluster passes: its partition, a time limit and 2 GB a job (the CPUs are
    SubmititSlurmConfig's, one a rank)."""
    return ["-m", "hydra/launcher=submitit_slurm", f"hydra.launcher.partition={cluster.partition}", f"hydra.launcher.timeout_min={timeout_min}",
            "hydra.launcher.mem_gb=2"]


def _submitted(sweep_dir: Path) -> tuple[list[str], set[str]]:
    """The SLURM job ids submitit kept a result for (ARRAY_TASK of a sweep, a plain id for a job
    alone) and the #SBATCH flags of the one script it wrote."""
    (script,) = sweep_dir.glob(".submitit/*/*_submission.sh")
    flags = {line.split()[1] for line in script.read_text().splitlines() if line.startswith("#SBATCH ")}
    return sorted(result.parent.name for result in sweep_dir.glob(".submitit/*/*_result.pkl")), flags


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

    job_ids, flags = _submitted(sweep_dir)
    assert {f"--partition={slurm_cluster.partition}", "--time=10", "--cpus-per-task=1", "--mem=2GB", "--nodes=1", "--ntasks-per-node=1",
            "--array=0-1%2"} <= flags
    assert not any(flag.startswith(("--gpus", "--gres")) for flag in flags)  # backend=cpu asks for no GPU
    assert len(job_ids) == 2 and {job_id.split("_")[1] for job_id in job_ids} == {"0", "1"}  # one array, a task per job
    jobs = {job_id: slurm_cluster.finished(job_id) for job_id in job_ids}
    for job_id, job in jobs.items():
        assert job.get("JobState") == "COMPLETED" and job["ExitCode"] == "0:0", (job_id, job)
        assert job["Partition"] == slurm_cluster.partition and job["NodeList"] == slurm_cluster.hostname and job["NumCPUs"] == "1"
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


def test_a_two_rank_job_is_given_a_cpu_per_rank(tmp_path: Path, slurm_cluster: SlurmCluster):
    """SLURM binds a job's task, and with it every rank its agent starts, to the CPUs the job asked
    for: one when sbatch names none, where two gloo ranks would share a core. SubmititSlurmConfig
    asks for dist.nproc; the 2-rank job gets both of the node's CPUs and trains as one 2-rank run."""
    args = [*_launcher(slurm_cluster), "dist.nproc=2", "data=random", "train.steps=2", "tracking=none"]
    proc = run_cli(args, cwd=tmp_path, timeout=300, env=slurm_cluster.env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + slurm_cluster.logs()
    (sweep_dir,) = tmp_path.glob("multirun/*/*")
    (job_id,), flags = _submitted(sweep_dir)
    assert "--cpus-per-task=2" in flags
    job = slurm_cluster.finished(job_id)
    assert job.get("JobState") == "COMPLETED" and job["NumCPUs"] == "2", job
    summary = json.loads((sweep_dir / "0" / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["settings"]["world_size"] == 2 and summary["steps"] == 2


def test_a_job_killed_without_a_result_is_seen_through_sacct_and_recorded_failed(tmp_path: Path, slurm_cluster: SlurmCluster,
                                                                                 tracking: ClusterTracking):
    """The `kill` job SIGKILLs its own process at step 0, as the OOM killer would: no result file,
    so the submitting command learns of its end from sacct (FAILED), records it FAILED with its
    stderr's path, and the sweep's other job finishes."""
    args = [*_launcher(slurm_cluster), "fault.kind=none,kill", "fault.step=0", *FAST, f"tracking.uri={tracking.url}",
            "tracking.experiment=slurm-dead"]
    proc = run_cli(args, cwd=tmp_path, timeout=300, env=slurm_cluster.env)
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:] + slurm_cluster.logs()  # the sweep ended, and says a job failed
    (sweep_dir,) = tmp_path.glob("multirun/*/*")
    job_ids = sorted(p.parent.name for p in sweep_dir.glob(".submitit/*/*_log.err"))  # ARRAY_TASK, the dead one's too
    states = {job_id: slurm_cluster.run("sacct", "-n", "-X", "-P", "-o", "State,ExitCode", "-j", job_id).stdout.strip() for job_id in job_ids}
    (done_id, dead_id) = job_ids
    assert states[done_id] == "COMPLETED|0:0" and states[dead_id].startswith("FAILED|"), states  # FAILED|9:0: srun's code for a task SIGKILLed
    runs = tracking.runs("slurm-dead")
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    children = {r.data.params["fault.kind"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert children["none"].info.status == "FINISHED"
    assert children["kill"].info.status == "FAILED" and "died without a result" in children["kill"].data.tags["error"]
    assert parent.data.tags["jobs"] == "1 finished, 1 failed"
    dead = json.loads((sweep_dir / "1" / "summary.json").read_text())
    assert dead["status"] == "failed" and f"{dead_id}_0_log.err" in dead["error"]


# Preemption and the time limit (src/train/preempt.py): two jobs of one sweep, identical but for
# their MLflow run names, a CPU each, so both run at once on the same thread count; one is stopped
# mid-run and requeued, the other runs straight, and their final losses must be the same bits.
# fp32 on CPU is what makes "the same" exact (tests/system/test_preemption.py).
TWINS = ["tracking.run_name=straight,stopped", "precision=fp32", "dist.nproc=1", "data=random", "tracking.system_metrics=false"]


def _start_sweep(args: list[str], cwd: Path, cluster: SlurmCluster) -> subprocess.Popen:
    env = {**os.environ, **cluster.env, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    return subprocess.Popen([sys.executable, "-m", "src.run", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _wait(ready, what: str, proc: subprocess.Popen, cluster: SlurmCluster, timeout_s: float = 180):
    """Poll `ready()` until it returns something true; fail if the sweep ends or `timeout_s` passes first."""
    deadline = time.monotonic() + timeout_s
    while True:
        found = ready()
        if found:
            return found
        if proc.poll() is not None or time.monotonic() > deadline:
            out = proc.stdout.read() if proc.poll() is not None else f"still running after {timeout_s:.0f} s"
            pytest.fail(f"no {what}: {out[-3000:]}\n{cluster.logs()}")
        time.sleep(0.2)


def _stopped_job(cwd: Path) -> tuple[Path, str] | None:
    """Once the `stopped` twin (sweep job 1) has logged 3 steps: its job folder and SLURM job id."""
    for metrics in cwd.glob("multirun/*/*/1/metrics.jsonl"):
        sweep_dir = metrics.parent.parent
        tasks = [p.name for p in sweep_dir.glob(".submitit/*_1") if p.is_dir()]
        if len(metrics.read_text().splitlines()) >= 3 and tasks:
            return metrics.parent, tasks[0]
    return None


def _check_twins(proc: subprocess.Popen, job_dir: Path, job_id: str, sig: str, cluster: SlurmCluster, tracking: ClusterTracking,
                 experiment: str, steps: int) -> int:
    """After the sweep: the stopped twin was requeued once by submitit, resumed from the checkpoint of
    the step it stopped at and ended with the straight twin's final loss, bit for bit, in one MLflow
    run whose curve is whole. Returns that step."""
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out[-3000:] + cluster.logs()
    straight = json.loads((job_dir.parent / "0" / "summary.json").read_text())
    resumed = json.loads((job_dir / "summary.json").read_text())
    at = resumed["start_step"]
    assert resumed["status"] == "finished" and 3 <= at < steps, resumed
    assert Path(resumed["resumed_from"]).name == f"step_{at:08d}" and (job_dir / "checkpoints" / f"step_{at:08d}" / "manifest.json").exists()
    assert resumed["final_loss"] == straight["final_loss"] and straight["start_step"] == 0  # bit for bit
    # SLURM's side: one job, run twice (sacct keeps the first attempt as REQUEUED)
    job = cluster.finished(job_id)  # submitit returns at the result pickle; slurmd may not have reported the end yet
    assert job.get("JobState") == "COMPLETED" and job["Restarts"] == "1", job
    attempts = cluster.run("sacct", "-n", "-X", "-P", "-D", "-o", "State", "-j", job_id).stdout.split()
    assert attempts == ["REQUEUED", "COMPLETED"], attempts
    (log,) = job_dir.parent.glob(f".submitit/{job_id}/{job_id}_0_log.out")
    assert f"Requeued job {job_id}" in log.read_text()
    # MLflow: the stopped run continued, its every step logged once
    client = MlflowClient(tracking.url)
    run = client.get_run(resumed["mlflow_run_id"])
    assert run.info.status == "FINISHED" and run.info.run_name == "stopped" and "preempted" not in run.data.tags
    assert run.data.tags["restart_1.cause"] == f"{sig} at step {at}"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(steps))
    (parent,) = [r for r in tracking.runs(experiment) if r.data.tags.get("sweep") == "true"]
    assert parent.data.tags["jobs"] == "2 finished, 0 failed"
    return at


def test_scancel_usr1_mid_run_saves_and_the_requeued_job_ends_bit_identical(tmp_path: Path, slurm_cluster: SlurmCluster,
                                                                            tracking: ClusterTracking):
    """`scancel --signal=USR1` (what `sbatch --signal=USR1@90` sends ahead of a limit) to the stopped
    twin: it saves the step it is at and hands over to submitit, which requeues it as preempted (60
    minutes asked, a minute run: not its time limit, so no max_num_timeout needed); the job starts
    again, resumes and finishes."""
    steps = 300  # about 8 s of steps of 25 ms on one core: the signal lands mid-run
    args = [*_launcher(slurm_cluster, timeout_min=60), *TWINS, f"train.steps={steps}", f"tracking.uri={tracking.url}",
            "tracking.experiment=slurm-usr1"]
    proc = _start_sweep(args, tmp_path, slurm_cluster)
    try:
        job_dir, job_id = _wait(lambda: _stopped_job(tmp_path), "3 steps logged by the stopped twin", proc, slurm_cluster)
        done = slurm_cluster.run("scancel", "--signal=USR1", job_id)
        assert done.returncode == 0, done.stderr
        _check_twins(proc, job_dir, job_id, "SIGUSR1", slurm_cluster, tracking, "slurm-usr1", steps)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)


def test_a_job_at_its_time_limit_is_requeued_by_submitit_and_resumes_from_its_checkpoint(tmp_path: Path, slurm_cluster: SlurmCluster,
                                                                                         tracking: ClusterTracking):
    """The stopped twin's time limit cut to a minute mid-run: slurmctld sends submitit's SIGUSR2
    `signal_delay_s` ahead of it (at its next time-limit check, every 30 s); the job saves, submitit
    counts a timeout (max_num_timeout=1 allows one) and requeues it. The limit is put back to 10
    minutes before the requeued job starts, which resumes and finishes."""
    # about 40 s of steps of 25 ms on a quiet core, past the up to 30 s the warning takes to come
    steps = 1600
    args = [*_launcher(slurm_cluster, timeout_min=10), "hydra.launcher.signal_delay_s=55", "hydra.launcher.max_num_timeout=1", *TWINS,
            f"train.steps={steps}", f"tracking.uri={tracking.url}", "tracking.experiment=slurm-timeout"]
    proc = _start_sweep(args, tmp_path, slurm_cluster)
    try:
        job_dir, job_id = _wait(lambda: _stopped_job(tmp_path), "3 steps logged by the stopped twin", proc, slurm_cluster)
        # a minute: less than signal_delay_s (55 s) is left once the job has run 5 s, so the warning is due at once
        done = slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=1")
        assert done.returncode == 0, done.stderr
        summary = job_dir / "summary.json"
        status = _wait(lambda: summary.exists() and json.loads(summary.read_text())["status"], "stop at the time limit's warning",
                       proc, slurm_cluster, timeout_s=120)
        assert status == "preempted", f"the run {status} before slurmctld's warning came: a faster machine needs more than {steps} steps"
        done = slurm_cluster.run("scontrol", "update", f"JobId={job_id}", "TimeLimit=10")
        assert done.returncode == 0, done.stderr
        _check_twins(proc, job_dir, job_id, "SIGUSR2", slurm_cluster, tracking, "slurm-timeout", steps)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    (log,) = job_dir.parent.glob(f".submitit/{job_id}/{job_id}_0_log.out")
    assert "this job is timed-out" in log.read_text()  # submitit's count of timeouts, not a preemption
