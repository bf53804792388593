"""Which rank's failure the one-line report names when several ranks end at once; how CPU ranks start."""
from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from src.distributed.launch import ERROR_NOTE, FORKSERVER, _first_failure, launch_ranks


def _raised(tmp: Path, rank: int, message: str) -> ProcessFailure:
    error_file = tmp / f"error{rank}.json"
    error_file.write_text(json.dumps({"message": {"message": message, "extraInfo": {"timestamp": "1"}}}))
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(error_file))


def _signalled(rank: int) -> ProcessFailure:
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=-signal.SIGABRT, error_file="/nonexistent")


def test_a_rank_that_raised_is_named_over_a_peer_aborted_in_a_collective(tmp_path: Path):
    # Rank 0 aborted (its gloo peer went away) and was reaped first; rank 1 raised the cause.
    err = ChildFailedError("train", {0: _signalled(0), 1: _raised(tmp_path, 1, "CheckpointError: checkpoint x could not be loaded")})
    assert _first_failure(err) == "rank 1 failed: CheckpointError: checkpoint x could not be loaded"


def test_the_rank_note_stands_in_for_a_missing_error_file(tmp_path: Path):
    no_file = ProcessFailure(local_rank=1, pid=101, exitcode=1, error_file="/nonexistent")
    (tmp_path / ERROR_NOTE.format(rank=1)).write_text("ValueError: bad shard")
    err = ChildFailedError("train", {0: _signalled(0), 1: no_file})
    assert _first_failure(err, str(tmp_path)) == "rank 1 failed: ValueError: bad shard"


def test_only_signals_names_the_signal():
    err = ChildFailedError("train", {0: _signalled(0), 1: _signalled(1)})
    assert _first_failure(err) in {"rank 0 failed: killed by signal SIGABRT", "rank 1 failed: killed by signal SIGABRT"}


def test_a_rank_killed_after_it_noted_its_error_is_named_by_the_note(tmp_path: Path):
    # The NaN drill under load: rank 0 raised and wrote its note, then the agent's SIGTERM reached it
    # before the elastic wrapper's error file; rank 1 aborted (SIGABRT) when rank 0 left gloo.
    (tmp_path / ERROR_NOTE.format(rank=0)).write_text("NonFiniteLoss: non-finite loss nan (grad norm nan) at step 3")
    terminated = ProcessFailure(local_rank=0, pid=100, exitcode=-signal.SIGTERM, error_file="/nonexistent")
    err = ChildFailedError("train", {1: _signalled(1), 0: terminated})
    assert _first_failure(err, str(tmp_path)) == "rank 0 failed: NonFiniteLoss: non-finite loss nan (grad norm nan) at step 3"


def test_a_note_that_only_says_the_peer_left_loses_to_the_cause(tmp_path: Path):
    (tmp_path / ERROR_NOTE.format(rank=0)).write_text("DistBackendError: Connection closed by peer [127.0.0.1]:1234")
    (tmp_path / ERROR_NOTE.format(rank=1)).write_text("InjectedFault: injected fault at step 2")
    failures = {r: ProcessFailure(local_rank=r, pid=100 + r, exitcode=1, error_file="/nonexistent") for r in (0, 1)}
    assert _first_failure(ChildFailedError("train", failures), str(tmp_path)) == "rank 1 failed: InjectedFault: injected fault at step 2"


def _rank_view(name: str) -> tuple[int, str | None]:
    return os.getppid(), os.environ.get(name)


@pytest.mark.skipif(not FORKSERVER, reason="this platform has no forkserver")
def test_cpu_ranks_fork_from_a_server_started_from_the_launchers_environment_of_the_moment(monkeypatch):
    """Two launches in one process (a sequential sweep's jobs) with a variable changed between them:
    each launch's ranks see the value it had when they started, though both were forked from a
    forkserver (their parent, not this process) that imported the project before forking."""
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)  # launch_ranks sets it for the ranks; undone after the test
    views = {}
    for value in ("first", "second"):
        monkeypatch.setenv("PERFLAB_LAUNCH_MARK", value)
        views[value] = launch_ranks(_rank_view, ("PERFLAB_LAUNCH_MARK",), nproc=2, forkserver=True)
    for value, ranks in views.items():
        assert sorted(ranks) == [0, 1] and {seen for _, seen in ranks.values()} == {value}
        parents = {parent for parent, _ in ranks.values()}
        assert len(parents) == 1 and os.getpid() not in parents, parents
