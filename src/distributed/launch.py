"""Start the ranks of a run through PyTorch's elastic launcher (what torchrun runs underneath).

The Hydra process composes the config once and owns the run directory; each rank is spawned with
the resolved config as a plain dict, so there is one output directory per run, never one per rank.
A rank that fails ends the whole group (the agent stops the others rather than let them hang in a
collective) and surfaces here as one line: the rank and its error.
"""
from __future__ import annotations

import contextlib
import dataclasses
import logging
import multiprocessing
import os
import re
import signal
import uuid
from collections.abc import Callable, Collection
from pathlib import Path
from typing import Any

from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
from torch.distributed.launcher.api import LaunchConfig, elastic_launch


class RankFailed(RuntimeError):
    """A rank exited with an error; str() is '<rank N> <error>' for the one-line report.
    `ranks`: the global ranks this node's agent ran (on several nodes: whether rank 0 was here)."""

    def __init__(self, message: str, ranks: frozenset[int] = frozenset()):
        super().__init__(message)
        self.ranks = ranks


GENERIC = "To enable traceback see"
ERROR_NOTE = ".rank{rank}.error"
# What a rank raises when a peer left first: a consequence, never the cause to name.
_PEER_GONE = re.compile(r"DistBackendError|Connection (closed|reset) by peer|Broken pipe|connectFullMesh")
# The agent's and torch.multiprocessing's loggers: a failing rank's traceback is about 28 lines
# of theirs; it belongs in run.log, the console gets the one line `error: rank N failed: ...`.
_TORCH_LOGGERS = ("torch.distributed.elastic", "torch.multiprocessing")


def _describe(rank: int, failure: Any, notes_dir: str | None) -> tuple[str, bool]:
    """One rank's failure as (line, is_cause): a raised exception is a cause, a signal is not."""
    message = failure.message
    if isinstance(message, dict):
        message = message.get("message", "")
    message = str(message).strip().splitlines()
    last = message[-1] if message else ""
    note = Path(notes_dir) / ERROR_NOTE.format(rank=rank) if notes_dir else None
    if note is not None and note.exists():
        # The rank's own one-line note (src/train/trainer.py, record_failure), written as soon as it caught the
        # error: it holds even when the rank was then killed (SIGTERM from the agent, SIGABRT from
        # gloo when its peer left) before the elastic wrapper wrote its error file.
        text = note.read_text().strip()
        return text, not _PEER_GONE.search(text)
    if failure.exitcode < 0 or last.startswith("Signal"):
        return (f"killed by signal {failure.signal_name()}" if failure.exitcode < 0 else last), False
    return last or f"exit code {failure.exitcode}", True


def _first_failure(err: ChildFailedError, notes_dir: str | None = None) -> str:
    """The failure that explains the others.

    When one rank raises (a missing checkpoint shard, say) and exits, its peers still waiting in a
    gloo/NCCL collective abort with SIGABRT, sometimes before the raising rank is reaped, so the
    launcher's "first" failure can be a consequence. A rank that raised wins over one killed by a
    signal; among equals the launcher's first, then the lowest rank.
    """
    first, _ = err.get_first_failure()
    described = {rank: _describe(rank, failure, notes_dir) for rank, failure in err.failures.items()}
    rank = min(described, key=lambda r: (not described[r][1], r != first, r))
    return f"rank {rank} failed: {described[rank][0]}"


@contextlib.contextmanager
def torch_logs_to(log_file: Path | None):
    """Send the elastic agent's records to `log_file` (run.log) instead of the console."""
    saved = []
    handler = logging.FileHandler(log_file) if log_file is not None else logging.NullHandler()
    handler.setFormatter(logging.Formatter("[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"))
    for name in _TORCH_LOGGERS:
        logger = logging.getLogger(name)
        saved.append((logger, logger.propagate))
        logger.propagate = False
        logger.addHandler(handler)
    try:
        yield
    finally:
        for logger, propagate in saved:
            logger.removeHandler(handler)
            logger.propagate = propagate
        handler.close()


def _standard_start_method() -> None:
    """A spawned child calls set_start_method(<the parent's default>) before anything else. Inside
    a joblib (loky) worker of `hydra/launcher=joblib` that default is 'loky', which a fresh
    interpreter does not know: every rank died with "ValueError: cannot find context for 'loky'".
    The ranks are spawned whatever the default says, so reset it to a method every child knows."""
    if multiprocessing.get_start_method(allow_none=True) not in (None, "spawn", "fork", "forkserver"):
        multiprocessing.set_start_method("spawn", force=True)


# How CPU ranks start. A spawned rank is a fresh interpreter that imports torch and the project
# (5-7 s of CPU a rank on a 2-core machine); a forkserver imports them once, then forks each rank
# from itself, so a 2-rank CPU run starts in one import instead of two. GPU ranks are spawned:
# forking works for them too (the server's imports leave CUDA uninitialised; tests/integration/test_gpu.py
# runs two GPU ranks forked from a server that imported the trainer), but a GPU host has cores
# for every rank, so their imports run side by side and one import in the server saves no time.
FORKSERVER = "forkserver" in multiprocessing.get_all_start_methods()


def _fresh_forkserver(entry: Callable[..., Any]) -> bool:
    """A new forkserver for this launch, preloading the module of the ranks' entry; False where this
    Python's forkserver cannot be restarted (its internals differ), so the ranks are spawned. Ranks
    inherit the server's environment, not the launcher's at the time they start: a server kept from
    an earlier launch in this process (a sequential Hydra sweep, whose jobs may set variables of
    their own through hydra.job.env_set) would hand them that launch's. The server is stopped here
    and starts again, from the current environment, when the ranks are started."""
    from multiprocessing import forkserver

    server = getattr(forkserver, "_forkserver", None)  # the one torch's start_processes uses, through get_context("forkserver")
    if server is None or not hasattr(server, "_stop"):
        return False
    server._stop()
    # torch._dynamo too: FSDP2's fully_shard imports it in each rank otherwise (1.4 s of CPU a rank)
    server.set_forkserver_preload([entry.__module__, "torch._dynamo"])
    # Started here, ignoring the signals a process group gets at a SLURM preemption or time limit: a
    # forkserver they ended left torch's agent reading its ranks as exited (code 255) while they were
    # still saving. An ignored signal stays ignored across exec; the ranks take their defaults back
    # (RANK_SIGNALS, restore_rank_signals).
    saved = {sig: signal.signal(sig, signal.SIG_IGN) for sig in RANK_SIGNALS}
    try:
        server.ensure_running()
    finally:
        for sig, handler in saved.items():
            signal.signal(sig, handler)
    return True


RANK_SIGNALS = (signal.SIGTERM, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def restore_rank_signals() -> None:
    """A rank forked from the forkserver above starts with RANK_SIGNALS ignored: their defaults back."""
    for sig in RANK_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)


# The signals torch's agent turns into a shutdown (LaunchConfig.signals_to_handle's default; the
# field and the wait below read the same in torch 2.11, 2.13, 2.14.1 and 2.15.0): it raises
# SignalException, sends the signal to the ranks, waits up to 30 s for them to exit and SIGKILLs
# them. A rank that returns meanwhile waits for the agent to read its result
# (queue_finished_reading_event in torch's _wrap), which an agent shutting down never does: a
# 2-rank CPU run stopped by SIGTERM saved in 2 s, then sat out the other 28.
AGENT_SIGNALS = tuple(signal.Signals[name] for name in
                      next(f for f in dataclasses.fields(LaunchConfig) if f.name == "signals_to_handle").default.split(","))


def agent_signals(kept: Collection[signal.Signals]) -> str:
    """LaunchConfig.signals_to_handle without the signals the caller handles itself (a stop signal
    forwarded through a file, src/train/preempt.py's ForwardToRanks)."""
    return ",".join(sig.name for sig in AGENT_SIGNALS if sig not in kept)


def launch_ranks(entry: Callable[..., Any], args: tuple, nproc: int, nnodes: int = 1, max_restarts: int = 0, rdzv_endpoint: str = "",
                 log_dir: str | None = None, notes_dir: str | None = None, log_name: str = "run.log", run_id: str = "",
                 forkserver: bool = False, kept_signals: Collection[signal.Signals] = ()) -> dict[int, Any]:
    """Run `entry(*args)` on `nproc` local ranks of `nnodes` nodes, this one among them (an agent
    per node, meeting at `rdzv_endpoint` under the same `run_id`); returns {global rank: return
    value} of this node's ranks. The agent's records go to `notes_dir`/`log_name`. `forkserver`:
    fork the ranks from a fresh forkserver that imported the entry's module (FORKSERVER above),
    else, or where that server cannot be restarted, spawn them. For GPU ranks it holds only while
    importing that module leaves CUDA uninitialised (tests/integration/test_gpu.py checks the trainer's).
    `kept_signals`: signals whose handlers the caller installed, left out of the agent's
    (AGENT_SIGNALS): the ranks stop on them and return, and the agent reads what they return."""
    # Each rank gets an equal share of the cores; oversubscribed OpenMP threads make a 2-core
    # CPU run several times slower than it need be.
    # The cores are this process's (a SLURM task is bound to the CPUs it asked for), not the host's.
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, cores // nproc)))
    config = LaunchConfig(
        min_nodes=nnodes,
        max_nodes=nnodes,
        nproc_per_node=nproc,
        # one node: a fresh id a run; several: the same on every node, or they never meet
        run_id=run_id or (uuid.uuid4().hex[:12] if nnodes == 1 else f"perflab-{rdzv_endpoint}"),
        rdzv_backend="c10d",
        # torchrun --standalone's choice: port 0 lets the c10d store bind any free port.
        rdzv_endpoint=rdzv_endpoint or "localhost:0",
        max_restarts=max_restarts,
        start_method="spawn",
        monitor_interval=0.5,
        logs_specs=DefaultLogsSpecs(log_dir=log_dir),
        signals_to_handle=agent_signals(kept_signals),
    )
    if nnodes > 1:
        # A fresh store for the ranks each attempt, on the node of group rank 0. By default the
        # agents share one store through every attempt, whose stale keys (gloo's peer addresses)
        # a restarted rank would read; on one node env.py gives each attempt a key prefix of its
        # own, but on several nodes the agents count restarts apart (only the failed node's
        # agent counts one), so no prefix is the same on every node.
        os.environ["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    _standard_start_method()
    if forkserver and FORKSERVER and _fresh_forkserver(entry):
        config.start_method = "forkserver"
    try:
        with torch_logs_to(Path(notes_dir) / log_name if notes_dir else None):
            return elastic_launch(config, entry)(*args)
    except ChildFailedError as err:
        # This node's ranks: the agent numbers them global_rank = node_rank * nproc + local_rank,
        # so any failed one tells which (the failures hold only the ranks that failed).
        first = min(err.failures) // nproc * nproc if err.failures else 0
        raise RankFailed(_first_failure(err, notes_dir), frozenset(range(first, first + nproc))) from None
