"""The run's loss and throughput per step as one PNG (an MLflow artifact beside summary.json)."""
from __future__ import annotations

import json
import textwrap
from pathlib import Path
from types import SimpleNamespace


def plot_curves(steps, path: str | Path, title: str = "") -> Path:
    # matplotlib on first use: importing pyplot takes ~1 s of CPU, which every rank would pay at
    # start-up while only rank 0 draws, once, at the end
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [s.step for s in steps]
    fig, (ax_loss, ax_tps) = plt.subplots(1, 2, figsize=(11, 4))
    ax_loss.plot(xs, [s.loss for s in steps], marker=".")
    ax_loss.set_xlabel("step")
    ax_loss.set_ylabel("loss")
    ax_loss.grid(alpha=0.3)
    ax_tps.plot(xs, [s.tokens_per_s_per_device for s in steps], marker=".", color="tab:green")
    ax_tps.set_xlabel("step")
    ax_tps.set_ylabel("tokens/s per device")
    ax_tps.grid(alpha=0.3)
    # a long run name (the overrides) wrapped, not clipped at the figure's edge
    fig.suptitle(textwrap.fill(title, 110), fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return Path(path)


def read_metrics(path: str | Path) -> list[SimpleNamespace]:
    """metrics.jsonl as step records, the last record of a step winning: the whole run, across
    elastic restarts, where the training loop's own list holds only the last attempt's steps."""
    by_step = {}
    for line in Path(path).read_text().splitlines():
        if line.strip():
            record = json.loads(line)
            by_step[record["step"]] = SimpleNamespace(**record)
    return [by_step[k] for k in sorted(by_step)]
