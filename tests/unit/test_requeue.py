"""A job's `scontrol requeue` outlives the SIGTERM with which slurmctld ends the requeued job: the
client runs with SIGTERM ignored, both in a SLURM batch job (checkpoint.requeue) and inside
submitit's own requeue (src/distributed/cluster.py). The stand-in scontrol below sends itself that
SIGTERM mid-command, as the job's end does when it wins the race; the real SLURM path is
tests/system/test_slurm.py's."""
from __future__ import annotations

import logging
import os
import subprocess
from pathlib import Path

import pytest

from src.distributed.cluster import requeue_through, scontrol_requeue

# the job's SIGTERM lands while the command is still running; it records its arguments after it
SCONTROL = """#!/bin/sh
kill -TERM $$
echo "$@" > "$REQUEUE_LOG"
"""


@pytest.fixture
def stand_in(tmp_path: Path, monkeypatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    (bin_dir / "scontrol").write_text(SCONTROL)
    (bin_dir / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", f"{bin_dir}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("REQUEUE_LOG", str(tmp_path / "requeued"))
    return tmp_path / "requeued"


def test_the_requeue_command_survives_the_jobs_sigterm(stand_in: Path):
    plain = subprocess.run(["scontrol", "requeue", "7"], capture_output=True)
    assert plain.returncode == -15 and not stand_in.exists()  # what submitit's own call met
    done = scontrol_requeue("7")
    assert done.returncode == 0 and stand_in.read_text() == "requeue 7\n"


def test_submitits_requeue_goes_through_it(stand_in: Path, monkeypatch, caplog):
    """submitit 1.5.4's SignalHandler over a SlurmJobEnvironment: after requeue_through, the
    environment's requeue is the SIGTERM-proof one, with submitit's log line."""
    from submitit.core.job_environment import SignalHandler
    from submitit.slurm.slurm import SlurmJobEnvironment

    monkeypatch.setenv("SLURM_JOB_ID", "42")
    handler = SignalHandler(SlurmJobEnvironment(), None, None)
    requeue_through(handler.checkpoint_and_try_requeue)
    with caplog.at_level(logging.INFO):
        handler.env._requeue(3)
    assert stand_in.read_text() == "requeue 42\n"
    assert "Requeued job 42 (3 remaining timeouts)" in caplog.text


def test_a_handler_of_no_slurm_job_is_left_as_it_is():
    def plain_handler(signum, frame):
        pass

    requeue_through(plain_handler)  # no bound environment: nothing to replace, nothing raised
    assert not hasattr(plain_handler, "env")
