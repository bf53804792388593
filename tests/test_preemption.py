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

from tests.conftest import REPO

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
def test_a_stop_signal_saves_and_the_same_command_continues_bit_identically(tmp_path: Path, straight, nproc, sig, group):
    store = f"sqlite:///{tmp_path / 'mlflow.db'}"
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
