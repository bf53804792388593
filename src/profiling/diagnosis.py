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
        textbook       docs/SEED.md's two readings both hold
        remedy         docs/SEED.md's remedy for the verdict
        fusion         the fused kernel that removes it (an op of src/fusion/registry.py), or null
        margin_pct     percentage points to the nearest threshold that would change the verdict
        summary        one line: "layers.*.ffn/silu: memory-bound (margin 2.0 pts), 11.0% of step -> fused Triton SiLU-mul" } ],
    has_backward, share_of   whether backward kernels were captured, and so what a share is of
    kernels: [ every record: index, name, short_name, nvtx, duration_s, sm_pct, dram_pct, mem_pct,
               dram_bytes, fp32_flops, arithmetic_intensity, achieved_flops, occupancy_pct,
               op, category, module, bound, limiter ]
"""
from __future__ import annotations

import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict
from typing import Any

from src.fusion.ops import OPS
from src.profiling.categories import CATEGORIES, classify_op
from src.profiling.classify import COMPUTE_BOUND, GEMM_REMEDY, MEMORY_BOUND, NEITHER, Thresholds, Verdict, classify
from src.profiling.ncu_reader import KernelRecord

SCHEMA = "perflab.diagnosis/1"

# profiled op -> (the op of kernels/triton that fuses it away, how a person calls it): the op table's
# `diagnosed` rows, and the remedies that are no kernel's
FUSIONS = {
    **{profiled: (op.name, remedy) for op in OPS for profiled, remedy in op.diagnosed},
    "copy": (None, "drop the cast: fuse it into its producer"),
}


def _fusion_helps(bound: str, limiter: str) -> bool:
    """Fusion is the remedy only for memory-bound ops and latency-limited ones (small kernels whose
    launches and round trips to HBM dominate); a compute-bound or occupancy-limited kernel is not
    helped by fusing it."""
    return bound == MEMORY_BOUND or (bound == NEITHER and limiter == "latency")


def remedy_for(op: str, category: str, v: Verdict) -> str:
    """What to do about it: the op's own fix where fusion helps, a GEMM's fix for a GEMM below the
    roof, else the verdict's."""
    if _fusion_helps(v.bound, v.limiter) and op in FUSIONS:
        return FUSIONS[op][1]
    if category == "gemm" and v.bound != COMPUTE_BOUND:
        return GEMM_REMEDY
    return v.remedy


def fusion_for(module: str, op: str, bound: str, limiter: str) -> str | None:
    """The registry op that fuses this diagnosed op away, if fusion is the remedy."""
    if not _fusion_helps(bound, limiter):
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


def _classify_weighted(records: list[KernelRecord], thresholds: Thresholds) -> Verdict:
    """The verdict of a group of kernels from their time-weighted Speed-of-Light readings."""
    sm = _weighted((r.sm_pct, r.duration_s) for r in records)
    hbm = _weighted((r.dram_pct, r.duration_s) for r in records)
    occ = _weighted((r.occupancy_pct, r.duration_s) for r in records if r.occupancy_pct is not None)
    return classify(sm, hbm, None if math.isnan(occ) else occ, thresholds)


def diagnose(records: list[KernelRecord], thresholds: Thresholds = Thresholds(), source: str = "", unranged: str = "") -> dict[str, Any]:
    """`unranged` names the module of kernels launched with no NVTX range open (for a training step
    profiled by task=diagnose: backward, which the autograd engine runs on its own thread)."""
    labelled = []
    for r in records:
        op, category = classify_op(r.name)
        if op == "softmax" and r.nvtx and r.nvtx[-1] == "loss":
            op, category = "cross_entropy", "loss"  # F.cross_entropy launches log_softmax + nll
        labelled.append((r, op, category, module_of(r.nvtx) or unranged))
    # One verdict per kernel name in a module: the same kernel in different layers can read either
    # side of a threshold and get opposite verdicts; its time-weighted reading does not flip.
    same: dict[tuple[str, str, str], list] = defaultdict(list)
    for r, op, _category, module in labelled:
        same[(r.name, module, op)].append(r)
    verdicts = {key: _classify_weighted(rs, thresholds) for key, rs in same.items()}
    kernels = [(r, op, category, module, verdicts[(r.name, module, op)]) for r, op, category, module in labelled]
    total = sum(r.duration_s for r, *_ in kernels if not math.isnan(r.duration_s)) or math.nan
    # task=diagnose leaves backward unranged (the autograd thread): unranged="backward"
    has_backward = any(module == "backward" or any(n.startswith("bwd/") for n in r.nvtx) for r, _, _, module, _ in kernels)
    share_of = "step" if has_backward else "profiled kernels (no backward kernels in this capture)"

    groups: dict[tuple[str, str], list] = defaultdict(list)
    for item in kernels:
        groups[(item[3], item[1])].append(item)
    ops = []
    for (module, op), items in groups.items():
        time_s = sum(r.duration_s for r, *_ in items)
        v = _classify_weighted([r for r, *_ in items], thresholds)
        sm = _weighted((r.sm_pct, r.duration_s) for r, *_ in items)
        hbm = _weighted((r.dram_pct, r.duration_s) for r, *_ in items)
        key = f"{module}/{op}" if module else op
        share = time_s / total
        fusion = fusion_for(module, op, v.bound, v.limiter)
        fix = remedy_for(op, items[0][2], v)
        ops.append({
            "key": key, "module": module, "op": op, "category": items[0][2],
            "kernels": sorted({r.short_name for r, *_ in items}), "count": len(items),
            "time_s": time_s, "share": share, "sm_pct": sm, "hbm_pct": hbm,
            "bound": v.bound, "limiter": v.limiter, "textbook": v.textbook, "margin_pct": v.margin_pct, "remedy": fix,
            "fusion": fusion,
            "summary": f"{key}: {v.bound}{'' if v.bound != NEITHER else f' ({v.limiter})'} (margin {v.margin_pct:.1f} pts), "
                       f"{100 * share:.1f}% of {'step' if has_backward else 'profiled kernels'} -> {fix}",
        })
    ops.sort(key=lambda o: -o["time_s"])

    share_by_bound = {b: 0.0 for b in (MEMORY_BOUND, "compute-bound", NEITHER)}
    share_by_category = {c: 0.0 for c in CATEGORIES}
    for r, _op, category, _module, v in kernels:
        share_by_bound[v.bound] += r.duration_s / total
        share_by_category[category] += r.duration_s / total
    devices = sorted({r.device for r in records if r.device})
    return {
        "schema": SCHEMA,
        "source": source,
        "device": ", ".join(devices),
        "thresholds": asdict(thresholds),
        "kernel_count": len(records),
        "has_backward": has_backward,
        "share_of": share_of,
        "total_kernel_time_s": total,
        "share_by_bound": share_by_bound,
        "share_memory_bound": share_by_bound[MEMORY_BOUND],
        "share_by_category": {k: v for k, v in share_by_category.items() if v > 0},
        "ops": ops,
        "kernels": [
            {
                "index": r.index, "name": r.name, "short_name": r.short_name, "nvtx": r.nvtx,
                "duration_s": r.duration_s, "sm_pct": r.sm_pct, "dram_pct": r.dram_pct, "mem_pct": r.mem_pct,
                "dram_bytes": r.dram_bytes, "fp32_flops": r.fp32_flops, "tensor_flops": r.tensor_flops, "arithmetic_intensity": r.arithmetic_intensity,
                "achieved_flops": r.achieved_flops, "occupancy_pct": r.occupancy_pct,
                "op": op, "category": category, "module": module, "bound": v.bound, "limiter": v.limiter, "margin_pct": v.margin_pct,
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
    head = "| op | kernels | count | time (ms) | share | SM % | HBM % | verdict | margin | remedy |\n|---|---|---:|---:|---:|---:|---:|---|---:|---|"
    rows = []
    for o in diagnosis["ops"][:limit]:
        verdict = o["bound"] + (f" ({o['limiter']})" if o["bound"] == NEITHER else "") + (" *" if o["textbook"] else "")
        rows.append(
            f"| {o['key']} | {', '.join(o['kernels'])[:60]} | {o['count']} | {1e3 * o['time_s']:.3f} | {100 * o['share']:.1f}% "
            f"| {o['sm_pct']:.0f} | {o['hbm_pct']:.0f} | {verdict} | {o.get('margin_pct', math.nan):.1f} | {o['summary'].split('-> ', 1)[-1]} |"
        )
    note = [] if diagnosis.get("has_backward", True) else ["", "Shares are of the profiled kernels: this capture has no backward kernels."]
    t = {**vars(Thresholds()), **(diagnosis.get("thresholds") or {})}  # the readings this diagnosis used
    legend = ["", f"`*`: a textbook verdict, both of docs/SEED.md's readings hold (memory-bound: HBM >= {t['hbm_bound_pct']:g}% and "
              f"SM < {t['sm_idle_pct']:g}%; compute-bound: SM >= {t['sm_bound_pct']:g}% and HBM < {t['hbm_low_pct']:g}%); without it, "
              "the unit nearest its peak is past its threshold. `margin`: points to the nearest threshold that would change the verdict."]
    return "\n".join([head, *rows, *note, *legend])
