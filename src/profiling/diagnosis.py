"""From per-kernel ncu records to `diagnosis.json`: per module and op, its kernels, their share of
the profiled GPU time, the verdict and the remedy. `kernels=auto` reads this file.

Schema `perflab.diagnosis/1` (all times in seconds, shares as fractions of the profiled kernel time):

    schema, source, device, thresholds{...}, kernel_count, total_kernel_time_s,
    share_by_bound{memory-bound, compute-bound, neither}, share_memory_bound, share_by_category{...},
    ops: [ sorted by time, largest first
      { key            "layers.*.ffn/silu": module path (layer index folded to *) / op
        module, op, category,
        kernels        distinct short kernel names
        count          kernels launched
        time_s, share
        sm_pct, hbm_pct          time-weighted Speed-of-Light throughputs
        bound          memory-bound | compute-bound | neither
        limiter        hbm | sm | latency | occupancy
        textbook       SEED.md's two readings both hold
        remedy         SEED.md's remedy for the verdict
        fusion         the fused kernel that removes it (a kernels/triton registry op), or null
        summary        one line: "layers.*.ffn/silu: memory-bound, 11.0% of step -> fused Triton SiLU-mul" } ],
    kernels: [ every record: index, name, short_name, nvtx, duration_s, sm_pct, dram_pct, mem_pct,
               dram_bytes, fp32_flops, arithmetic_intensity, achieved_flops, occupancy_pct,
               op, category, module, bound, limiter ]
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from dataclasses import asdict
from typing import Any, Iterable

from src.profiling.categories import CATEGORIES, classify_op
from src.profiling.classify import MEMORY_BOUND, NEITHER, Thresholds, classify
from src.profiling.ncu_reader import KernelRecord

SCHEMA = "perflab.diagnosis/1"

# op -> (the registry op of kernels/triton that fuses it away, how a person calls it)
FUSIONS = {
    "silu": ("swiglu", "fused Triton SiLU-mul"),
    "mul": ("swiglu", "fused Triton SiLU-mul"),
    "rms_norm": ("rms_norm", "fused Triton RMSNorm (+ residual add)"),
    "add": ("rms_norm", "residual add fused into Triton RMSNorm"),
    "softmax": ("softmax", "fused Triton softmax"),
    "cross_entropy": ("cross_entropy", "fused Triton cross-entropy (loss and gradient in one pass)"),
    "adamw": (None, "fused AdamW (optim.fused=true)"),
    "copy": (None, "drop the cast: fuse it into its producer"),
}


def fusion_for(module: str, op: str, bound: str, limiter: str) -> str | None:
    """The registry op that fuses this diagnosed op away, if fusion is the remedy: only for
    memory-bound ops and latency-limited ones (small kernels whose launches and round trips to
    HBM dominate); a compute-bound or occupancy-limited kernel is not helped by fusing it."""
    if not (bound == MEMORY_BOUND or (bound == NEITHER and limiter == "latency")):
        return None
    if module.split("/")[0] == "loss" and op == "softmax":  # the log_softmax inside F.cross_entropy
        op = "cross_entropy"
    return FUSIONS.get(op, (None, None))[0]


def module_of(nvtx: list[str]) -> str:
    """Innermost NVTX range, with layer indices folded: ['profiled_step', 'fwd/layers.3.ffn'] -> 'layers.*.ffn'.
    Directly inside `profiled_step` (FSDP2's all-gather copy-in, casts) is 'step'."""
    if not nvtx:
        return ""
    inner = nvtx[-1]
    if inner == "profiled_step":
        return "step"
    inner = inner.split("/", 1)[1] if inner.startswith(("fwd/", "bwd/")) else inner
    return re.sub(r"\.\d+(\.|$)", r".*\1", inner)


def _weighted(values: Iterable[tuple[float, float]]) -> float:
    pairs = [(v, w) for v, w in values if not math.isnan(v)]
    total = sum(w for _, w in pairs)
    return sum(v * w for v, w in pairs) / total if total else math.nan


def diagnose(records: list[KernelRecord], thresholds: Thresholds = Thresholds(), source: str = "", unranged: str = "") -> dict[str, Any]:
    """`unranged` names the module of kernels launched with no NVTX range open (for a training step
    profiled by task=diagnose: backward, which the autograd engine runs on its own thread)."""
    kernels = []
    for r in records:
        op, category = classify_op(r.name)
        if op == "softmax" and r.nvtx and r.nvtx[-1] == "loss":
            op, category = "cross_entropy", "loss"  # F.cross_entropy launches log_softmax + nll
        v = classify(r.sm_pct, r.dram_pct, r.occupancy_pct, thresholds)
        kernels.append((r, op, category, module_of(r.nvtx) or unranged, v))
    total = sum(r.duration_s for r, *_ in kernels if not math.isnan(r.duration_s)) or math.nan

    groups: dict[tuple[str, str], list] = defaultdict(list)
    for item in kernels:
        groups[(item[3], item[1])].append(item)
    ops = []
    for (module, op), items in groups.items():
        time_s = sum(r.duration_s for r, *_ in items)
        sm = _weighted((r.sm_pct, r.duration_s) for r, *_ in items)
        hbm = _weighted((r.dram_pct, r.duration_s) for r, *_ in items)
        occ = _weighted((r.occupancy_pct, r.duration_s) for r, *_ in items if r.occupancy_pct is not None)
        v = classify(sm, hbm, None if math.isnan(occ) else occ, thresholds)
        key = f"{module}/{op}" if module else op
        share = time_s / total
        fusion = fusion_for(module, op, v.bound, v.limiter)
        fix = FUSIONS[op][1] if fusion else v.remedy
        ops.append({
            "key": key, "module": module, "op": op, "category": items[0][2],
            "kernels": sorted({r.short_name for r, *_ in items}), "count": len(items),
            "time_s": time_s, "share": share, "sm_pct": sm, "hbm_pct": hbm,
            "bound": v.bound, "limiter": v.limiter, "textbook": v.textbook, "remedy": v.remedy,
            "fusion": fusion,
            "summary": f"{key}: {v.bound}{'' if v.bound != NEITHER else f' ({v.limiter})'}, {100 * share:.1f}% of step -> {fix}",
        })
    ops.sort(key=lambda o: -o["time_s"])

    share_by_bound = {b: 0.0 for b in (MEMORY_BOUND, "compute-bound", NEITHER)}
    share_by_category = {c: 0.0 for c in CATEGORIES}
    for r, op, category, module, v in kernels:
        share_by_bound[v.bound] += r.duration_s / total
        share_by_category[category] += r.duration_s / total
    devices = sorted({r.device for r in records if r.device})
    return {
        "schema": SCHEMA,
        "source": source,
        "device": ", ".join(devices),
        "thresholds": asdict(thresholds),
        "kernel_count": len(records),
        "total_kernel_time_s": total,
        "share_by_bound": share_by_bound,
        "share_memory_bound": share_by_bound[MEMORY_BOUND],
        "share_by_category": {k: v for k, v in share_by_category.items() if v > 0},
        "ops": ops,
        "kernels": [
            {
                "index": r.index, "name": r.name, "short_name": r.short_name, "nvtx": r.nvtx,
                "duration_s": r.duration_s, "sm_pct": r.sm_pct, "dram_pct": r.dram_pct, "mem_pct": r.mem_pct,
                "dram_bytes": r.dram_bytes, "fp32_flops": r.fp32_flops, "arithmetic_intensity": r.arithmetic_intensity,
                "achieved_flops": r.achieved_flops, "occupancy_pct": r.occupancy_pct,
                "op": op, "category": category, "module": module, "bound": v.bound, "limiter": v.limiter,
            }
            for r, op, category, module, v in kernels
        ],
    }


def fusable_ops(diagnosis: dict[str, Any]) -> dict[str, list[str]]:
    """registry op -> the diagnosis lines that call for it: what `kernels=auto` swaps in, and why.
    Decided again from each op's verdict (fusion_for), so a file written under older rules reads
    the same as a new one."""
    if diagnosis.get("schema") != SCHEMA:
        raise ValueError(f"not a {SCHEMA} file (schema={diagnosis.get('schema')!r})")
    chosen: dict[str, list[str]] = defaultdict(list)
    for op in diagnosis["ops"]:
        fusion = fusion_for(op["module"], op["op"], op["bound"], op["limiter"])
        if fusion:
            chosen[fusion].append(op["summary"])
    return dict(chosen)


def top_ops_table(diagnosis: dict[str, Any], limit: int = 15) -> str:
    """Markdown table of the costliest ops, for the console, the docs and MLflow."""
    head = "| op | kernels | count | time (ms) | share | SM % | HBM % | verdict | remedy |\n|---|---|---:|---:|---:|---:|---:|---|---|"
    rows = []
    for o in diagnosis["ops"][:limit]:
        verdict = o["bound"] + (f" ({o['limiter']})" if o["bound"] == NEITHER else "") + (" *" if o["textbook"] else "")
        rows.append(
            f"| {o['key']} | {', '.join(o['kernels'])[:60]} | {o['count']} | {1e3 * o['time_s']:.3f} | {100 * o['share']:.1f}% "
            f"| {o['sm_pct']:.0f} | {o['hbm_pct']:.0f} | {verdict} | {o['summary'].split('-> ', 1)[-1]} |"
        )
    return "\n".join([head, *rows])
