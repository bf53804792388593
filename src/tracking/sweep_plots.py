"""A sweep's charts (the parent run's sweep.png and, for task=infer, latency.png).

Jobs are labelled by what they vary, one override a line (`precision=fp32` over `sharding=none`),
not by whole override strings: those, with an escaped tracking URI in them, ran into each other.
"""
from __future__ import annotations

from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from src.tracking.figures import lower_is_better  # noqa: E402


def _label(row: dict[str, Any]) -> str:
    # `edge.dtype=fp16` -> `dtype=fp16`: the group is the same for every job of the sweep
    return "\n".join(part.split("=", 1)[0].rsplit(".", 1)[-1] + "=" + part.split("=", 1)[1] if "=" in part else part
                     for part in row["run"].split())


def _figure(n_jobs: int, panels: int = 1):
    # ~1.1 in a bar keeps two-line labels apart; 6 in wide at least so the title fits on one line
    return plt.subplots(1, panels, figsize=(max(6.0, 1.1 * n_jobs * panels + 1.5), 4.2), squeeze=False)


def plot_headline(rows: list[dict[str, Any]], metric: str, path: Path, best: dict[str, Any] | None = None) -> Path:
    values = [r[metric] if isinstance(r.get(metric), (int, float)) else 0.0 for r in rows]
    colors = ["tab:red" if r["status"] != "finished" else ("tab:green" if r is best else "tab:blue") for r in rows]
    fig, axes = _figure(len(rows))
    ax = axes[0][0]
    bars = ax.bar(range(len(rows)), values, color=colors, width=0.6)
    ax.bar_label(bars, labels=[(f"{v:,.0f}" if abs(v) >= 100 else f"{v:.3g}") if r["status"] == "finished" else "failed" for v, r in zip(values, rows)], fontsize=8, padding=2)
    ax.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=8)
    ax.set_ylabel(metric.replace("_", " "))
    ax.margins(y=0.15)  # room for the value labels above the tallest bar
    direction = "lower" if lower_is_better(metric) else "higher"
    ax.set_title(f"{metric} per job ({direction} is better; green: best, red: failed)", fontsize=10)
    ax.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_latency(rows: list[dict[str, Any]], path: Path) -> Path:
    """task=infer sweeps: time to first token and decode step latency, p50 with the p90 above it, per job."""
    fig, axes = _figure(len(rows), panels=2)
    for ax, (name, key) in zip(axes[0], (("time to first token", "ttft"), ("decode step", "decode"))):
        p50 = [r.get(f"{key}_p50_ms") or 0.0 for r in rows]
        p90 = [max((r.get(f"{key}_p90_ms") or 0.0) - v, 0.0) for r, v in zip(rows, p50)]
        ax.bar(range(len(rows)), p50, label="p50", color="tab:blue", width=0.6)
        ax.bar(range(len(rows)), p90, bottom=p50, label="p90", color="tab:blue", alpha=0.35, width=0.6)
        ax.set_xticks(range(len(rows)), [_label(r) for r in rows], fontsize=8)
        ax.set_ylabel("ms (lower is better)")
        ax.set_title(name, fontsize=10)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


# the charts a task may declare for its sweeps (register_figures(..., sweep_plots=...)), each written as NAME.png
SWEEP_PLOTS = {"latency": plot_latency}
