"""A stop signal (SLURM's SIGTERM at preemption, `--signal=USR1@90` ahead of a time limit) to a real
run: the ranks finish the step, save it, flush every logged step to MLflow and end the run KILLED
(tag `preempted`), exit 128 + the signal; the same command then continues the same MLflow run from
that checkpoint and ends with the weights of a run never stopped."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.support.cli import REPO

# fp32 on fixed ranks: "the same" means the same bits. 60 steps of ~25 ms leave time to signal mid-run.
RUN = ["precision=fp32", "train.steps=60", "tracking.system_metrics=false", "hydra.run.dir=run"]


def _start(args: list[str], cwd: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen([sys.executable, "-m", "src.run", *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _logged(cwd: Path) -> int:
    path = cwd / "run" / "metrics.jsonl"
    return len(path.read_text().splitlines()) if path.exists() else 0


def _signal_mid_run(proc: subprocess.Popen, cwd: Path, sig: int, group: bool) -> tuple[str, float]:
    """The run's output, and the seconds from the signal to its exit."""
    deadline = time.monotonic() + 120
    while _logged(cwd) < 3:  # a few steps in: the ranks are in the loop
        assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.poll() is not None else "no step in 120 s"
        time.sleep(0.05)
    (os.killpg if group else os.kill)(proc.pid, sig)
    sent = time.monotonic()
    out, _ = proc.communicate(timeout=120)
    return out, time.monotonic() - sent


def _summary(cwd: Path) -> dict:
    return json.loads((cwd / "run" / "summary.json").read_text())


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> dict[int, dict]:
    """The final summaries of undisturbed runs, by rank count."""
    found = {}
    for nproc in (1, 2):
        cwd = tmp_path_factory.mktemp(f"straight{nproc}")
        proc = _start([*RUN, f"dist.nproc={nproc}", "tracking=none"], cwd)
        out, _ = proc.communicate(timeout=300)
        assert proc.returncode == 0, out
        found[nproc] = _summary(cwd)
    return found


@pytest.mark.parametrize(("nproc", "sig", "group"), [
    (1, signal.SIGUSR1, False),   # one rank in the launching process
    (2, signal.SIGUSR1, False),   # to the launcher alone: it hands the request to its ranks
    (2, signal.SIGTERM, True),    # to the whole process group, the metric writer too: SLURM's preemption
], ids=["1rank-usr1", "2ranks-usr1-launcher", "2ranks-term-group"])
def test_a_stop_signal_saves_and_the_same_command_continues_bit_identically(tmp_path: Path, straight, nproc, sig, group, mlflow_store):
    store = mlflow_store(tmp_path)
    args = [*RUN, f"dist.nproc={nproc}", f"tracking.uri={store}"]
    proc = _start(args, tmp_path)
    out, took = _signal_mid_run(proc, tmp_path, sig, group)
    assert proc.returncode == 128 + sig, out
    # torch's agent, had it taken the signal, would have waited its 30 s for ranks that had saved
    # and returned (src/distributed/launch.py's AGENT_SIGNALS), then SIGKILLed them
    assert took < 30, f"{took:.0f} s from the signal to the exit\n{out}"
    name = signal.Signals(sig).name
    first = _summary(tmp_path)
    at = first["preempted_at_step"]
    assert first["status"] == "preempted" and first["preempted_by"] == name and 3 <= at < 60, first
    assert (tmp_path / "run" / "checkpoints" / f"step_{at:08d}" / "manifest.json").exists()
    assert f"{name}: stopped after {at} of 60 steps, checkpoint step_{at:08d}" in out
    assert "Traceback" not in out
    client = MlflowClient(store)
    run = client.get_run(first["mlflow_run_id"])
    assert run.info.status == "KILLED" and run.data.tags["preempted"] == name
    # every step run before the stop reached MLflow, the writer's pending ones included
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(at))

    proc = _start(args, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    second = _summary(tmp_path)
    assert second["status"] == "finished" and second["start_step"] == at
    assert second["final_loss"] == straight[nproc]["final_loss"]  # bit for bit
    assert second["mlflow_run_id"] == first["mlflow_run_id"]  # one MLflow run, its curve whole
    run = client.get_run(second["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "preempted" not in run.data.tags
    assert run.data.tags["restart_1.cause"] == f"{name} at step {at}"
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(60))


def test_with_the_default_folders_the_same_command_continues_the_stopped_run_in_its_folder(tmp_path: Path, straight, mlflow_store):
    """No hydra.run.dir, no checkpoint.folder: SIGTERM stops the run in outputs/DATE/TIME; the same
    command, word for word, goes on in that folder, from its checkpoint, in its MLflow run, and ends
    bit-identical to an undisturbed twin; another command gets a folder of its own."""
    store = mlflow_store(tmp_path)
    args = [a for a in RUN if not a.startswith("hydra.run.dir")] + ["dist.nproc=1", f"tracking.uri={store}"]
    proc = _start(args, tmp_path)
    deadline = time.monotonic() + 120
    while not list(tmp_path.glob("outputs/*/*/metrics.jsonl")) or len(next(tmp_path.glob("outputs/*/*/metrics.jsonl")).read_text().splitlines()) < 3:
        assert proc.poll() is None and time.monotonic() < deadline, "no step in 120 s"
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, out
    (folder,) = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
    first = json.loads((folder / "summary.json").read_text())
    at = first["preempted_at_step"]
    # the line says what the next command does, and names it
    assert f"`python -m src.run {' '.join(args)}` continues it: this folder, its checkpoint and its MLflow run" in out, out[-3000:]

    proc = _start(args, tmp_path)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0, out
    assert f"perflab: continuing {folder.relative_to(tmp_path)}: stopped by SIGTERM at step {at} of 60" in out
    assert [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")] == [folder]  # no second folder
    second = json.loads((folder / "summary.json").read_text())
    assert second["status"] == "finished" and second["start_step"] == at
    assert second["final_loss"] == straight[1]["final_loss"]  # bit for bit
    assert second["mlflow_run_id"] == first["mlflow_run_id"]
    client = MlflowClient(store)
    assert sorted(m.step for m in client.get_metric_history(second["mlflow_run_id"], "loss")) == list(range(60))
    assert len((folder / "metrics.jsonl").read_text().splitlines()) == 60

    proc = _start([*args, "train.steps=2", "tracking=none"], tmp_path)  # another command: a folder of its own (its MLflow run not read)
    out, _ = proc.communicate(timeout=300)
    assert proc.returncode == 0 and "continuing" not in out, out
    assert len(list(tmp_path.glob("outputs/*/*/summary.json"))) == 2


def test_no_stop_signals_leaves_sigusr1_to_end_the_process(tmp_path: Path):
    """checkpoint.on_signal=[]: no handler, no checkpoint; SIGUSR1 ends the run as it ends any program."""
    proc = _start([*RUN, "dist.nproc=1", "tracking=none", "checkpoint.on_signal=[]"], tmp_path)
    _signal_mid_run(proc, tmp_path, signal.SIGUSR1, False)
    assert proc.returncode == -signal.SIGUSR1
    assert not (tmp_path / "run" / "checkpoints").exists()


def test_the_launcher_takes_the_stop_signals_from_torchs_agent_and_a_later_repeat_stops_at_once(tmp_path: Path):
    """In the launching process: the stop signals write the ranks' stop file and are left out of the
    agent's (it would shut the ranks down without reading what they return); the same signal again
    within SAME_REQUEST_S is the same request, later it raises torch's SignalException, as the agent's
    own handler would; on exit the handlers before it come back and the file goes."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from src.distributed.launch import agent_signals
    from src.train.preempt import SAME_REQUEST_S, STOP_FILE, ForwardToRanks

    before = signal.getsignal(signal.SIGHUP)
    stop_file = tmp_path / STOP_FILE
    with ForwardToRanks([signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1], tmp_path) as forward:
        assert set(forward.handled) == {signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1}
        assert agent_signals(forward.handled) == "SIGINT,SIGQUIT"  # Ctrl-C stays torch's: stop now
        os.kill(os.getpid(), signal.SIGHUP)
        time.sleep(0.05)  # Python runs the handler in this thread at its next instruction
        assert stop_file.read_text() == "SIGHUP"
        os.kill(os.getpid(), signal.SIGUSR1)  # another signal meanwhile: the request stands
        os.kill(os.getpid(), signal.SIGHUP)  # the same again at once: the same request
        time.sleep(0.05)
        assert stop_file.read_text() == "SIGHUP"
        forward.request.at -= SAME_REQUEST_S + 1
        with pytest.raises(SignalException, match="SIGHUP received twice"):
            os.kill(os.getpid(), signal.SIGHUP)
            time.sleep(0.05)
    assert signal.getsignal(signal.SIGHUP) == before and not stop_file.exists()
    assert agent_signals(()) == "SIGTERM,SIGINT,SIGHUP,SIGQUIT"  # torch's own list, where no run directory takes them


def test_a_command_continues_only_its_own_newest_run_and_only_where_it_stopped_and_saved(tmp_path: Path):
    """src/train/resume_check.py stopped_run over run folders as Hydra leaves them: the newest folder
    of the same overrides (in any order) counts; finished, failed or without a summary, it is not
    continued, nor is an older stopped one behind it."""
    import shutil

    import yaml

    from src.train.resume_check import stopped_run

    def run(time_: str, overrides: list[str], status: str | None, saved: bool = True) -> Path:
        folder = tmp_path / "outputs" / "2026-12-07" / time_
        (folder / ".hydra").mkdir(parents=True)
        (folder / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
        if status is not None:
            (folder / "summary.json").write_text(json.dumps({"status": status, "preempted_at_step": 7}))
        if saved:
            (folder / "checkpoints" / "step_00000007").mkdir(parents=True)
            (folder / "checkpoints" / "step_00000007" / ".metadata").write_bytes(b"")
        return folder

    ours = ["train.steps=60", "checkpoint.interval=10"]
    stopped = run("09-00-00", ours, "preempted")
    run("09-30-00", ["train.steps=5"], "finished")  # another command's, newer
    assert stopped_run(tmp_path / "outputs", [*reversed(ours), "hydra.job.chdir=false"])[0] == stopped
    assert stopped_run(tmp_path / "outputs", ["train.steps=60"]) is None
    unsaved = run("10-00-00", ours, "preempted", saved=False)
    assert stopped_run(tmp_path / "outputs", ours) is None  # the newest stopped before its first save
    for status in ("finished", "failed", None):
        shutil.rmtree(unsaved)
        unsaved = run("10-00-00", ours, status)
        assert stopped_run(tmp_path / "outputs", ours) is None, status
