"""Rank 0's view of a run while it trains: a live rich progress line on a terminal, one plain line per
logged step otherwise (CI logs, files), and the seed's own line when asked for."""
from __future__ import annotations

import logging
import sys

from src.train.loop import StepStats
from src.train.metrics import format_metric

log = logging.getLogger("src.train")


def describe(s: StepStats) -> str:
    return (
        f"loss {s.loss:.4f} | gnorm {s.grad_norm:.3f} | {s.step_time_s * 1e3:.0f} ms | "
        f"{s.tokens_per_s_per_device:,.0f} tok/s/dev | MFU {format_metric(s.mfu, '{:.1f}%')} | "
        f"mem {s.peak_mem_alloc_gb:.2f}/{s.peak_mem_reserved_gb:.2f} GB"
    )


class ProgressReporter:
    def __init__(self, total_steps: int, live: bool, seed_line: bool):
        self.total, self.seed_line = total_steps, seed_line
        self.progress = None
        if live and sys.stdout.isatty():
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

            self.progress = Progress(
                TextColumn("[bold]train"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("{task.fields[info]}")
            )
            self.task = self.progress.add_task("train", total=total_steps, info="")
            self.progress.start()

    def __call__(self, s: StepStats) -> None:
        line = describe(s)
        if self.progress is not None:
            self.progress.update(self.task, completed=s.step + 1, info=line)
            log.debug("step %d [%d/%d] | %s", s.step, s.step + 1, self.total, line)
        else:
            # Steps count from 0 everywhere (errors, metrics.jsonl, MLflow, fault.step, the seed's
            # line); the bracket says how many of train.steps are done.
            log.info("step %d [%d/%d] | %s", s.step, s.step + 1, self.total, line)
        if self.seed_line:
            # docs/SEED.md prints rank 0's own max_memory_allocated, not the max over ranks.
            print(f"Step {s.step} | Loss: {s.loss:.4f} | Peak VRAM/GPU: {s.rank0_peak_mem_alloc_gb:.2f} GB", flush=True)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
