"""Leave out given lines of this process's stderr while torch.profiler runs.

torch's C++ writes two kinds of lines straight to file descriptor 2, past Python's warnings and
logging, each time a profile starts and stops, in every rank:

- Kineto's `USDT:... profiler_start` / `profiler_stop`: markers meant for USDT probes, logged at
  Kineto's highest level, so the only Kineto setting that hides them (`KINETO_LOG_LEVEL=6`) hides
  its errors too;
- c10's `CPUAllocator.cpp:...] Memory block of unknown size was allocated before the profiling
  started ...`: a block allocated before the memory profiling began, freed during it (a training
  loop always has one); a glog-style WARNING, which only `TORCH_CPP_LOG_LEVEL=ERROR` would hide, with
  every other C++ warning of the run.

`DroppedLines` points descriptor 2 at a pipe and copies what arrives, line by line, to the real
stderr, leaving out the lines that match; everything else passes, in order, as it is written.
"""
from __future__ import annotations

import os
import re
import sys
import threading

TORCH_PROFILER_NOISE = re.compile(
    rb"^USDT:.*\] profiler_(start|stop)\s*$"
    rb"|CPUAllocator\.cpp:\d+\] Memory block of unknown size was allocated before the profiling started"
)


class DroppedLines:
    """While open, lines written to file descriptor 2 (by Python or C++) that `pattern` matches
    (re.search, bytes) are left out; the rest reach stderr. Counts what it left out in `dropped`."""

    def __init__(self, pattern: re.Pattern[bytes] = TORCH_PROFILER_NOISE):
        self.pattern = pattern
        self.dropped = 0
        self._saved: int | None = None
        self._thread: threading.Thread | None = None

    def __enter__(self) -> DroppedLines:
        sys.stderr.flush()
        self._saved = os.dup(2)
        read, write = os.pipe()
        os.dup2(write, 2)
        os.close(write)  # descriptor 2 is now the pipe's only writer: restoring it ends the copy
        self._thread = threading.Thread(target=self._copy, args=(read, self._saved), name="stderr-lines", daemon=True)
        self._thread.start()
        return self

    def _copy(self, read: int, out: int) -> None:
        with os.fdopen(read, "rb") as pipe:
            for line in pipe:
                if self.pattern.search(line):
                    self.dropped += 1
                    continue
                view = memoryview(line)
                while view:
                    view = view[os.write(out, view):]
        os.close(out)

    def __exit__(self, *exc) -> None:
        if self._saved is None:
            return
        sys.stderr.flush()
        # descriptor 2 back to the real stderr, with its own copy (the thread closes the saved one
        # when the pipe ends, which a child process started meanwhile may hold open for a while)
        os.dup2(self._saved, 2)
        self._saved = None
        self._thread.join(timeout=5)
