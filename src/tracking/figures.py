"""Which figures each task reports, which one it is compared on, and which way is better.

Shared by a sweep's parent run and table (src/tracking/sweep.py) and `python -m src.compare`, so a
latency is never starred for being the largest.
"""
from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

_TRAIN = ("tokens_per_s_per_device", "mfu", "peak_mem_gb", "final_loss", "step_time_s")
# The figures shown and compared per task, the headline first.
TASK_FIGURES: dict[str, tuple[str, ...]] = {
    "train": _TRAIN,
    "profile": _TRAIN,
    "diagnose": ("share_memory_bound",),
    "infer": ("decode_tokens_per_s", "decode_p50_ms", "ttft_p50_ms", "prefill_tokens_per_s", "rel_err"),
}
# What a task's sweep.csv holds beyond those: the p90s and sizes a table in a terminal leaves out.
TASK_EXTRA: dict[str, tuple[str, ...]] = {
    "train": ("tokens_per_s", "overhead_frac"),
    "profile": ("tokens_per_s",),
    "diagnose": ("device_name",),
    "infer": ("device_name", "ttft_p90_ms", "decode_p90_ms", "compile_s"),
}
LOWER_IS_BETTER = {"peak_mem_gb", "peak_mem_reserved_gb", "final_loss", "step_time_s", "share_memory_bound", "overhead_frac",
                   "rel_err", "compile_s", "first_run_s", "skipped_steps"}


def headline(task: str) -> str:
    return TASK_FIGURES.get(task, _TRAIN)[0]


def lower_is_better(metric: str) -> bool:
    """Latencies (`*_ms`), memory (`*_gb`), errors and losses; tokens/s, MFU and the rest: higher."""
    return metric in LOWER_IS_BETTER or metric.endswith(("_ms", "_gb", "_bytes", "_err")) or "loss" in metric


def is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and not math.isnan(v)


def best_row(rows: Iterable[dict[str, Any]], metric: str) -> dict[str, Any] | None:
    """The finished row with the best `metric`, or None where none has it."""
    done = [r for r in rows if r.get("status") == "finished" and is_number(r.get(metric))]
    if not done:
        return None
    pick = min if lower_is_better(metric) else max
    return pick(done, key=lambda r: r[metric])
