"""Ranks for the multi-process tests: each a spawned interpreter that prints its Python stack when a
signal kills it.

torch.multiprocessing reports a rank killed by a signal as "process 1 terminated with signal
SIGSEGV" and nothing else; once (CI, tests/test_step_in_backward.py) that was all there was to go
on. With faulthandler on in the rank, the stack of every thread goes to the rank's stderr, which the
test's captured output holds."""
from __future__ import annotations

import faulthandler
from collections.abc import Callable
from typing import Any

import torch.multiprocessing as mp


def _traced(rank: int, fn: Callable[..., None], *args: Any) -> None:
    faulthandler.enable(all_threads=True)
    fn(rank, *args)


def spawn_ranks(fn: Callable[..., None], args: tuple, nprocs: int) -> None:
    """`fn(rank, *args)` in `nprocs` spawned processes; raises as torch.multiprocessing does if one fails.
    `fn` must be importable (a module-level function of a test module)."""
    mp.start_processes(_traced, args=(fn, *args), nprocs=nprocs, start_method="spawn")
