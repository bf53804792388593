"""The diagnosis as pictures (matplotlib, no display needed).

Left: the roofline. Each kernel whose report carries FLOP counters sits at (arithmetic intensity,
achieved FLOP/s) under the device's memory and compute ceilings. Right: Speed of Light, every
kernel at (HBM %, SM %) of peak with the classifier's thresholds drawn in, so the verdict of each
point can be read off. Points are sized by kernel time and coloured by verdict.
"""
from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COLORS = {"memory-bound": "tab:red", "compute-bound": "tab:blue", "neither": "tab:gray"}

# (HBM bytes/s, {dtype: dense FLOP/s}) by device: the measured copy ceiling (read + written) where
# known (DESIGN.md), datasheet rates otherwise.
CEILINGS = {
    "H200": (4.25e12, {"bf16 tensor": 989e12, "fp32": 67e12}),
    "H100": (3.35e12, {"bf16 tensor": 989e12, "fp32": 67e12}),
    "A100": (2.0e12, {"bf16 tensor": 312e12, "fp32": 19.5e12}),
}


def _ceilings(device: str) -> tuple[float, dict[str, float]]:
    for key, value in CEILINGS.items():
        if key in device:
            return value
    return CEILINGS["H200"]


def plot_roofline(diagnosis: dict[str, Any], path: str | Path, title: str = "") -> Path:
    kernels = [k for k in diagnosis["kernels"] if not math.isnan(k["duration_s"] or math.nan)]
    total = sum(k["duration_s"] for k in kernels) or 1.0
    bw, peaks = _ceilings(diagnosis.get("device", ""))
    fig, (ax_roof, ax_sol) = plt.subplots(1, 2, figsize=(14, 6))

    with_flops = [k for k in kernels if k["arithmetic_intensity"] and k["achieved_flops"]]
    xs = [1e-2, 1e4]
    for label, peak in peaks.items():
        ridge = peak / bw
        ax_roof.plot([xs[0], ridge, xs[1]], [bw * xs[0], peak, peak], lw=1.5, label=f"{label} {peak / 1e12:.0f} TFLOP/s, HBM {bw / 1e12:.2f} TB/s")
    for k in with_flops:
        ax_roof.scatter(k["arithmetic_intensity"], k["achieved_flops"], s=20 + 2000 * k["duration_s"] / total, c=COLORS[k["bound"]], alpha=0.6, edgecolors="k", linewidths=0.3)
    ax_roof.set_xscale("log")
    ax_roof.set_yscale("log")
    ax_roof.set_xlabel("arithmetic intensity (FLOP / DRAM byte)")
    ax_roof.set_ylabel("achieved FLOP/s")
    top = sorted(diagnosis["ops"], key=lambda o: -o["time_s"])[:8]
    for o in top:  # each costly op named at its longest kernel, as on the right
        mine = [k for k in with_flops if (k.get("module"), k.get("op")) == (o["module"], o["op"])]
        if mine:
            k = max(mine, key=lambda k: k["duration_s"])
            ax_roof.annotate(o["key"], (k["arithmetic_intensity"], k["achieved_flops"]), xytext=(5, 3), textcoords="offset points", fontsize=7, alpha=0.8)
    tensor = sum(1 for k in with_flops if k.get("tensor_flops"))
    ax_roof.set_title(f"roofline: {len(with_flops)} of {len(kernels)} kernels with FLOPs, {tensor} with tensor-pipe FLOPs", fontsize=10)
    ax_roof.legend(loc="lower right", fontsize=8)
    ax_roof.grid(True, which="both", alpha=0.2)

    t = diagnosis["thresholds"]
    for k in kernels:
        ax_sol.scatter(k["dram_pct"], k["sm_pct"], s=20 + 2000 * k["duration_s"] / total, c=COLORS[k["bound"]], alpha=0.6, edgecolors="k", linewidths=0.3)
    ax_sol.axvline(t["hbm_bound_pct"], color="tab:red", ls="--", lw=1)
    ax_sol.axhline(t["sm_bound_pct"], color="tab:blue", ls="--", lw=1)
    ax_sol.plot([0, 100], [0, 100], color="k", lw=0.5, ls=":")
    for o in top:
        ax_sol.annotate(o["key"], (o["hbm_pct"], o["sm_pct"]), xytext=(5, 3), textcoords="offset points", fontsize=7, alpha=0.8)
    for bound, color in COLORS.items():
        ax_sol.scatter([], [], c=color, label=bound)
    ax_sol.set_xlim(0, 100)
    ax_sol.set_ylim(0, 100)
    ax_sol.set_xlabel("HBM throughput, % of peak (gpu__dram_throughput)")
    ax_sol.set_ylabel("SM throughput, % of peak (sm__throughput)")
    ax_sol.set_title(f"speed of light: {100 * diagnosis['share_memory_bound']:.0f}% of kernel time memory-bound")
    ax_sol.legend(loc="lower left", fontsize=8)
    ax_sol.grid(True, alpha=0.2)

    fig.suptitle(title or f"{diagnosis.get('device', '')}: {diagnosis['kernel_count']} kernels, {1e3 * diagnosis['total_kernel_time_s']:.2f} ms")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
