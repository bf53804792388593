"""Why kernels=auto chose what it chose: per op, what the diagnosis said, the gain it predicts, the
gain measured, and the pick. A table for the run's log and MLflow, and a figure of predicted
against measured gain.

The prediction is the roofline's: the eager op's measured time less the least time its bytes can
take at the GPU's memory bandwidth (or its FLOPs at the tensor cores' rate, whichever is longer),
the most a fused kernel could save. The measured gain is the eager time less the chosen candidate's.
Realized (measured / predicted) says how close the chosen kernel came to the floor.
"""
from __future__ import annotations

import logging
import textwrap
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

from src.dtypes import torch_dtype
from src.fusion.choice import OPTIMIZER, AutoChoice
from src.fusion.measure import BLOCK, uses

log = logging.getLogger("src.train")
TABLE_FILE = "kernels_auto.md"
FIGURE_FILE = "kernels_auto.png"


@dataclass
class Row:
    op: str
    verdict: str
    """what the diagnosis said of the op's kernels, or that there was none"""
    eager_ms: float | None
    """the baseline: eager (the block: its ops as picked one by one)"""
    floor_ms: float | None
    """the least a step's uses of the op take at the GPU's ceilings; None: not modelled (the block)"""
    picked: str
    picked_ms: float | None

    @property
    def predicted_ms(self) -> float | None:
        return None if self.eager_ms is None or self.floor_ms is None else max(self.eager_ms - self.floor_ms, 0.0)

    @property
    def measured_ms(self) -> float | None:
        return None if self.eager_ms is None or self.picked_ms is None else self.eager_ms - self.picked_ms


def floor_ms(op: str, cfg: DictConfig, device: str) -> float | None:
    """The least GPU ms a step's uses of `op` take: bytes at the HBM ceiling, or FLOPs at the
    tensor-core one, whichever is longer (src/profiling/roofline.py's ceilings of `device`)."""
    from src.fusion.cases import make_case
    from src.profiling.roofline import _ceilings

    bandwidth, peaks = _ceilings(device)
    if op == OPTIMIZER:  # AdamW: reads the weight, its gradient and both moments, writes the weight and the moments
        state = 2 if str(cfg.optim.get("state_dtype", "float32")) == "bfloat16" else 4
        numel = sum(sum(u.shape) for u in uses(cfg).get(op, [])) or None  # its use's shape: each parameter's elements
        return None if numel is None else 1e3 * numel * (12 + 4 * state) / bandwidth
    op_uses = uses(cfg).get(op) or []
    if not op_uses:
        return None
    element = torch_dtype(cfg.precision.param_dtype).itemsize
    total = 0.0
    for use in op_uses:
        case = make_case(use.case, use.shape)
        seconds = (case.bytes_fwd(element) + case.bytes_bwd(element)) / bandwidth
        flops = case.flops_fwd + case.flops_bwd
        if flops:
            seconds = max(seconds, flops / peaks["bf16 tensor" if element < 4 else "fp32"])
        total += use.per_step * seconds
    return 1e3 * total


def rows(choice: AutoChoice, cfg: DictConfig) -> list[Row]:
    """One row per op timed (or, with no GPU to time on, per op the diagnosis called for)."""
    out = []
    for op in dict.fromkeys([*choice.measured, *choice.ops]):
        ms = {k: v for k, v in choice.measured.get(op, {}).items() if not k.endswith(".host")}
        verdict = "; ".join(choice.ops.get(op, [])) or "timed: no diagnosis"
        picked = choice.picks.get(op, "")
        floor = None if op == BLOCK else _floor(op, cfg, choice.device)
        base = "picked" if op == BLOCK else "eager"  # the block's baseline: its ops as picked one by one
        out.append(Row(op, verdict, ms.get(base), floor, picked or "not timed", ms.get(picked)))
    return out


def _floor(op: str, cfg: DictConfig, device: str) -> float | None:
    try:
        return floor_ms(op, cfg, device)
    except (ValueError, KeyError, TypeError) as err:  # an op with no case of this shape: no prediction
        log.debug("kernels=auto: no floor for %s: %s", op, err)
        return None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def table(rows_: list[Row]) -> str:
    """At most 80 columns: op, the two gains and the pick; the verdicts below, one line each."""
    head = f"{'op':<22}{'eager ms':>9}{'floor ms':>9}{'predicted':>10}{'measured':>9}{'realized':>9}  pick"
    lines = [head, "-" * len(head)]
    for r in rows_:
        realized = f"{100 * r.measured_ms / r.predicted_ms:.0f}%" if r.measured_ms is not None and r.predicted_ms else "-"
        lines.append(f"{r.op[:21]:<22}{_ms(r.eager_ms):>9}{_ms(r.floor_ms):>9}{_ms(r.predicted_ms):>10}{_ms(r.measured_ms):>9}"
                     f"{realized:>9}  {r.picked[:12]}")
    lines += ["", "ms a step. predicted: eager less the roofline floor, the most fusion saves;",
              "measured: eager less the pick (the block: against its ops as picked). verdicts:"]
    lines += [w for r in rows_ for w in textwrap.wrap(f"{r.op}: {r.verdict}", 80, initial_indent="  ", subsequent_indent="    ")]
    return "\n".join(lines)


def figure(rows_: list[Row], path: Path, title: str) -> Path | None:
    """Predicted against measured gain per op, as bars; None where no op has both."""
    shown = [r for r in rows_ if r.predicted_ms is not None and r.measured_ms is not None]
    if not shown:
        return None
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(4.5, 1.3 * len(shown) + 2), 3.6))
    x = range(len(shown))
    ax.bar([i - 0.2 for i in x], [r.predicted_ms for r in shown], 0.4, label="predicted (roofline)", color="tab:gray")
    ax.bar([i + 0.2 for i in x], [r.measured_ms for r in shown], 0.4, label="measured", color="tab:blue")
    ax.set_xticks(list(x), [f"{r.op}\n{r.picked}" for r in shown], fontsize=8)
    ax.axhline(0, color="black", lw=0.8)
    ax.set_ylabel("gain over eager, ms a step")
    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def record(choice: AutoChoice, cfg: DictConfig, run_dir: Path | None, tracker) -> list[Row]:
    """The table in the log, and in the run folder and MLflow with its figure."""
    made = rows(choice, cfg)
    text = table(made)
    log.info("kernels=auto, op by op:\n%s", text)
    if run_dir is not None:
        (run_dir / TABLE_FILE).write_text(text + "\n")
        tracker.log_artifact(run_dir / TABLE_FILE)
        png = figure(made, run_dir / FIGURE_FILE, f"kernels=auto on {choice.device or 'this GPU'}")
        if png is not None:
            tracker.log_artifact(png)
    return made
