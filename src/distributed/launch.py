"""Start the ranks of a run through PyTorch's elastic launcher (what torchrun runs underneath).

The Hydra process composes the config once and owns the run directory; each rank is spawned with
the resolved config as a plain dict, so there is one output directory per run, never one per rank.
A rank that fails ends the whole group (the agent stops the others rather than let them hang in a
collective) and surfaces here as one line: the rank and its error.
"""
from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any, Callable

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class RankFailed(RuntimeError):
    """A rank exited with an error; str() is '<rank N> <error>' for the one-line report."""


GENERIC = "To enable traceback see"
ERROR_NOTE = ".rank{rank}.error"


def _first_failure(err: ChildFailedError, notes_dir: str | None = None) -> str:
    rank, failure = err.get_first_failure()
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message).strip().splitlines()
    last = message[-1] if message else f"exit code {failure.exitcode}"
    if last.startswith(GENERIC) and notes_dir:
        # No error file from the elastic wrapper: the rank's own one-line note (src/train/worker.py).
        for r in sorted(err.failures, key=lambda r: (r != rank, r)):
            note = Path(notes_dir) / ERROR_NOTE.format(rank=r)
            if note.exists():
                return f"rank {r} failed: {note.read_text().strip()}"
    if failure.exitcode < 0 or last.startswith("Signal"):
        last = f"killed by signal {failure.signal_name()}" if failure.exitcode < 0 else last
    return f"rank {rank} failed: {last}"


def launch_ranks(entry: Callable[..., Any], args: tuple, nproc: int, nnodes: int = 1, max_restarts: int = 0, rdzv_endpoint: str = "", log_dir: str | None = None, notes_dir: str | None = None) -> dict[int, Any]:
    """Run `entry(*args)` on `nproc` local ranks (times `nnodes`); returns {global rank: return value}."""
    # Each rank gets an equal share of the cores; oversubscribed OpenMP threads make a 2-core
    # CPU run several times slower than it need be.
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // nproc)))
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        run_id=uuid.uuid4().hex[:12],
        rdzv_backend="c10d",
        # torchrun --standalone's choice: port 0 lets the c10d store bind any free port.
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        max_restarts=max_restarts,
        start_method="spawn",
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
    )
    try:
        return elastic_launch(config, entry)(*args)
    except ChildFailedError as err:
        raise RankFailed(_first_failure(err, notes_dir)) from None
