"""Ranks for the multi-process tests: each a spawned interpreter that prints its Python stack when a
signal kills it, and that ends without the interpreter's teardown once its work is done.

torch.multiprocessing reports a rank killed by a signal as "process 1 terminated with signal
SIGSEGV" and nothing else; once (CI) that was all there was to go
on. With faulthandler on in the rank, the stack of every thread goes to the rank's stderr, which the
test's captured output holds.

On torch 2.15.0 a gloo rank sometimes aborted after its work and its destroy_process_group, in the
interpreter's teardown ("terminate called without an active exception", SIGABRT, no Python frame
on the stack): CI's 2.15 stage failed so in a gloo test file and had shown it twice before in
eight runs, on a loaded 2-core machine; 24 runs idle and 16 under load here did not. Upstream's
pytorch/pytorch#179291 (closed unmerged) describes the same abort: gloo's threads still holding
work whose tensors are freed while the interpreter is being torn down. A rank whose function
returned has written what the test reads, so it leaves through os._exit(0), after flushing its
output; a rank that raised still exits through torch.multiprocessing's error path."""
from __future__ import annotations

import faulthandler
import os
import sys
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _traced(rank: int, fn: Callable[..., None], *args: Any) -> None:
    faulthandler.enable(all_threads=True)
    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes; raises as torch.multiprocessing does if one fails.
    `fn` must be importable (a module-level function of a test module)."""
    mp.start_processes(_traced, args=(fn, *args), nprocs=nprocs, start_method="spawn")
