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
look for at every step (`STOP_FILE` in the run directory): torch's agent forwards SIGTERM itself,
not SIGUSR1 or SIGUSR2, and a rank's pid is the agent's to know, not ours.
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

# A SIGTERM to the process group reaches a rank twice within milliseconds: from the kernel, and
# forwarded by torch's agent. Both are one request; a second one later than this stops at once.
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


class StopRequest:
    """The signals of `sigs` marked as they arrive; `agreed()`, called once a step on every rank,
    says the signal all ranks stop on (0: go on)."""

    def __init__(self, sigs: list[signal.Signals], stop_file: Path | None, group: dist.ProcessGroup | None = None):
        self.received, self.received_at = 0, 0.0
        self.stop_file = stop_file
        self.group = group
        self.work = None
        self.flag = torch.zeros(1, dtype=torch.int32)
        self.previous: dict[signal.Signals, object] = {}
        if threading.current_thread() is threading.main_thread():  # Python runs signal handlers there alone
            for sig in sigs:
                self.previous[sig] = signal.signal(sig, self._on_signal)

    def _on_signal(self, signum: int, frame) -> None:
        now = time.monotonic()
        if self.received == signum and now - self.received_at > SAME_REQUEST_S:
            # asked again, later: stop now, as without the handler
            from torch.distributed.elastic.multiprocessing.api import SignalException

            raise SignalException(f"{signal.Signals(signum).name} received twice", sigval=signal.Signals(signum))
        if not self.received:
            self.received, self.received_at = signum, now

    def local(self) -> int:
        if not self.received and self.stop_file is not None and self.stop_file.exists():
            name = self.stop_file.read_text().strip()
            self.received = int(signal.Signals[name]) if name in signal.Signals.__members__ else int(signal.SIGTERM)
        return self.received

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
    """In the launching process, while the ranks run: a stop signal writes STOP_FILE for them. The
    handlers before it (submitit's) are put back on exit, for the caller to hand over to after the save."""

    def __init__(self, sigs: list[signal.Signals], run_dir: Path | None):
        self.sigs, self.stop_file = sigs, (run_dir / STOP_FILE if run_dir is not None else None)
        self.previous: dict[signal.Signals, object] = {}
        self.received = 0

    def __enter__(self) -> ForwardToRanks:
        if self.stop_file is None or threading.current_thread() is not threading.main_thread():
            return self
        self.stop_file.unlink(missing_ok=True)  # a previous attempt's (a requeued job's) request is done
        for sig in self.sigs:
            if sig in (signal.SIGTERM, signal.SIGHUP):
                continue  # torch's agent forwards these to the ranks itself
            self.previous[sig] = signal.signal(sig, self._on_signal)
        return self

    def _on_signal(self, signum: int, frame) -> None:
        self.received = self.received or signum
        self.stop_file.write_text(signal.Signals(signum).name)

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        if self.stop_file is not None:
            self.stop_file.unlink(missing_ok=True)
