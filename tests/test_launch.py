"""Which rank's failure the one-line report names when several ranks end at once."""
from __future__ import annotations

import json
import signal
from pathlib import Path

from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from src.distributed.launch import ERROR_NOTE, _first_failure


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
