"""Stop at a step boundary on a signal, every rank after the same step, and save that step.

SLURM warns a job before it ends it: SIGTERM at preemption and at the time limit (then SIGKILL
after KillWait, 30 s by default), or the signal of `sbatch --signal=USR1@90` that many seconds
ahead; submitit asks for SIGUSR2. A rank that receives one of checkpoint.on_signal marks it; the
ranks agree on the mark through an asynchronous all-reduce on a gloo group of their own, read one
step later (it never makes the device wait), so all stop before the same step. The loop then saves
that step and ends; the run ends KILLED with the tag `preempted`, and the process exits
128 + the signal's number, what a shell reports for a process the signal ended. A second signal of
the same kind seconds later stops at once, as if no handler were there.

The launching process (the elastic agent's) forwards what it receives through a file the ranks
look for at every step (`STOP_FILE` in the run directory): a rank's pid is the agent's to know, not
ours, and torch's agent, left to handle SIGTERM or SIGHUP itself, shuts the ranks down without
reading what they return (src/distributed/launch.py's AGENT_SIGNALS), so it is handed none of the
stop signals. A second signal seconds later reaches the agent as torch's SignalException: it sends
the signal to the ranks, which stop at once.
"""
from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist

log = logging.getLogger("src.train")

# One request may reach a process twice within moments (a signal to its process group, and the same
# signal sent to each process by a scheduler): one request. The same signal later than this stops at once.
SAME_REQUEST_S = 2.0

STOP_FILE = ".stop_signal"
"""in the run directory: the name of a stop signal the launching process received, for its ranks"""


def stop_signals(names, submitit: bool) -> list[signal.Signals]:
    """checkpoint.on_signal's signals; a submitit job adds its timeout signal (SIGUSR2 unless its
    SUBMITIT_PREEMPT_SIGNAL says otherwise), so that the save comes before submitit's requeue."""
    sigs = [signal.Signals[str(n)] for n in names]
    if submitit and sigs:
        extra = signal.Signals["SIG" + os.environ.get("SUBMITIT_PREEMPT_SIGNAL", "USR2").removeprefix("SIG")]
        sigs += [extra] if extra not in sigs else []
    return sigs


def exit_code(signum: int) -> int:
    return 128 + int(signum)


class _Request:
    """A process's stop request: the first stop signal it received (0: none) and when."""

    def __init__(self) -> None:
        self.signum, self.at = 0, 0.0

    def take(self, signum: int) -> bool:
        """Record `signum`; True where it is the first request. The same signal again, later than
        SAME_REQUEST_S, raises torch's SignalException: stop now, as without a handler."""
        if self.signum == signum and time.monotonic() - self.at > SAME_REQUEST_S:
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"{signal.Signals(signum).name} received twice", sigval=signal.Signals(signum))
        if self.signum:
            return False
        self.signum, self.at = signum, time.monotonic()
        return True


class StopRequest:
    """The signals of `sigs` marked as they arrive; `agreed()`, called once a step on every rank,
    says the signal all ranks stop on (0: go on)."""

    def __init__(self, sigs: list[signal.Signals], stop_file: Path | None, group: dist.ProcessGroup | None = None):
        self.request = _Request()
        self.stop_file = stop_file
        self.group = group
        self.work = None
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.previous: dict[signal.Signals, object] = {}
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there alone
            for sig in sigs:
                self.previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        self.request.take(signum)

    def local(self) -> int:
        if not self.request.signum and self.stop_file is not None and self.stop_file.exists():
            name = self.stop_file.read_text().strip()
            self.request.take(int(signal.Signals[name]) if name in signal.Signals.__members__ else int(signal.SIGTERM))
        return self.request.signum

    def agreed(self) -> int:
        if self.group is None:
            return self.local()
        seen = 0
        if self.work is not None:
            self.work.wait()
            seen = int(self.flag.item())
        self.flag = torch.tensor([self.local()], dtype=torch.int32)
        self.work = dist.all_reduce(self.flag, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
        return seen

    def close(self) -> None:
        """Wait for the last agreement in flight (every rank issued as many), put the handlers back."""
        if self.work is not None:
            self.work.wait()
            self.work = None
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        self.previous = {}


class ForwardToRanks:
    """In the launching process, while the ranks run: a stop signal writes STOP_FILE for them.
    `handled` names the signals it took, for the agent to leave alone (launch_ranks' kept_signals).
    The handlers before it (submitit's) are put back on exit, for the caller to hand over to after the save."""

    def __init__(self, sigs: list[signal.Signals], run_dir: Path | None):
        self.sigs, self.stop_file = sigs, (run_dir / STOP_FILE if run_dir is not None else None)
        self.previous: dict[signal.Signals, object] = {}
        self.request = _Request()

    @property
    def handled(self) -> tuple[signal.Signals, ...]:
        return tuple(self.previous)

    def __enter__(self) -> ForwardToRanks:
        if self.stop_file is None or threading.current_thread() is not threading.main_thread():
            return self
        self.stop_file.unlink(missing_ok=True)  # a previous attempt's (a requeued job's) request is done
        for sig in self.sigs:
            self.previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        if self.request.take(signum):
            self.stop_file.write_text(signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)
