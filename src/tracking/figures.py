"""Which figures each task reports, which one it is compared on, and which way is better.

Shared by a sweep's parent run and table (src/tracking/sweep.py) and `python -m src.compare`, so a
latency is never starred for being the largest. Each task declares its own (register_figures, in
its package's __init__.py); src/tasks.py and src/compare.py import every task package, so
whatever runs tasks or compares them has the declarations.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class TaskFigures:
    """What one task declares (a register_figures call beside it, in its package's __init__.py)."""

    shown: tuple[str, ...]
    """the figures shown and compared, the headline first"""
    extra: tuple[str, ...] = ()
    """what a sweep.csv holds beyond those: the p90s and sizes a table in a terminal leaves out"""
    sweep_plots: tuple[str, ...] = ()
    """charts a sweep draws beside its headline's (src/tracking/sweep_plots.py's SWEEP_PLOTS)"""
    excluded: Callable[[dict[str, Any]], str | None] | None = None
    """(row) -> why a finished run may not be the best (a quality bound it misses), or None"""


# task name -> its figures, filled by the tasks: tracking/ names no task, and imports none
_REGISTRY: dict[str, TaskFigures] = {}
# What a task that declares none (kernel_bench, whose figures are its table's rows) is compared on.
DEFAULT_HEADLINE = "tokens_per_s_per_device"


def register_figures(task: str, shown: tuple[str, ...], extra: tuple[str, ...] = (), sweep_plots: tuple[str, ...] = (),
                     excluded: Callable[[dict[str, Any]], str | None] | None = None) -> None:
    """Declare a task's figures: `shown` with its headline first, what sweep.csv adds, the sweep's
    charts, and the rule that leaves a run out of the ranking (`excluded`)."""
    _REGISTRY[task] = TaskFigures(tuple(shown), tuple(extra), tuple(sweep_plots), excluded)


def figures_of(task: str) -> TaskFigures:
    """The task's declaration; none shown, none extra, no charts for a task that made none."""
    return _REGISTRY.get(task, TaskFigures(()))


LOWER_IS_BETTER = {"joules_per_token", "cost_per_mtok", "peak_mem_gb", "peak_mem_reserved_gb", "final_loss", "step_time_s", "share_memory_bound", "overhead_frac",
                   "rel_err", "compile_s", "first_run_s", "skipped_steps"}


def headline(task: str) -> str:
    return (figures_of(task).shown or (DEFAULT_HEADLINE,))[0]


def lower_is_better(metric: str) -> bool:
    """Latencies (`*_ms`), memory (`*_gb`), errors and losses; tokens/s, MFU and the rest: higher."""
    return metric in LOWER_IS_BETTER or metric.endswith(("_ms", "_gb", "_bytes", "_err")) or "loss" in metric


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def left_out(rows: Iterable[dict[str, Any]]) -> dict[int, str]:
    """id(row) -> why its task's rule leaves that finished run out of the ranking."""
    out = {}
    for r in rows:
        rule = figures_of(str(r.get("task") or "")).excluded
        why = rule(r) if rule is not None and r.get("status") == "finished" else None
        if why:
            out[id(r)] = why
    return out


def best_row(rows: Iterable[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The finished row with the best `metric` that its task's rule does not leave out, or None."""
    rows = list(rows)
    out = left_out(rows)
    done = [r for r in rows if r.get("status") == "finished" and is_number(r.get(metric)) and id(r) not in out]
    if not done:
        return None
    pick = min if lower_is_better(metric) else max
    return pick(done, key=lambda r: r[metric])
