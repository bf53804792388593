"""Injected faults (cfg.fault): a rank that raises, dies by SIGKILL, or sees a non-finite loss at a
chosen step, so tests and drills exercise the real failure paths of the launcher and tracking."""
from __future__ import annotations

import os
import signal

import torch


class InjectedFault(RuntimeError):
    pass


def inject(kind: str, fault_rank: int, fault_step: int, rank: int, step: int, loss: torch.Tensor) -> torch.Tensor:
    """Called with the loss before backward. Fires once: not again after an elastic restart."""
    if kind == "none" or rank != fault_rank or step != fault_step or os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0":
        return loss
    if kind == "raise":
        raise InjectedFault(f"injected fault at step {step}")
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if kind == "nan":
        return loss * float("nan")
    return loss
