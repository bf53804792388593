"""Step anatomy: where a training step's time goes, from the torch.profiler trace of task=profile.

Per profiled step (averaged): device time by category (GEMM, attention, norm/elementwise/cast,
optimizer, FSDP2's copy-in/out, communication, other), the communication that nothing hides
(NCCL kernel time while no other kernel runs on any stream), idle time (no kernel at all) split by
what the device waited for, the step's device time, and the GEMM floor: model FLOPs per step at a
stated GEMM rate (by default the rate bf16 dense GEMMs were measured to reach), the time the step would take
if it were only its GEMMs at full speed. Category times overlap (NCCL runs beside compute), so they
add up to more than the step.

Idle time is split at each gap by the kernel that ends it: if the host's call that launched it
returned after the device had gone idle, the device waited for the host (`host late`: the step is
host-bound there); if it was launched before, it sat queued behind something other than a kernel
(`queued`: another stream's event, a copy, a wait). The gaps that cost the most a step are
listed, grouped by the kernels either side, each group with its longest single gap (a one-off
shows there) and, for a host-late one, what the launching thread did in it: the ops, ranges and
runtime calls with the most self time inside the gap (`aten::item` over `cudaStreamSynchronize` is a
sync; `cudaFuncGetAttributes` a module loading; a step range with no op under it is Python, a
compile, a collection). The profiler lengthens the host's path (a few us a launch with CPU activity
on), so host-late idle in a profiled step is an upper bound on the unprofiled step's.

The device figures count the work the profiled steps launched (each kernel tied to its launch call,
a CUDA graph's kernels to the graph's launch), not every kernel the trace holds: a device running
behind its host finishes the step before the window inside it.

On a CPU there are no device kernels: the same categories are CPU-op self time, and the device
figures are absent.

    python -m src.profiling.anatomy outputs/DATE/TIME/profile/trace_rank0.json --flops-per-step 5.9e13
"""
from __future__ import annotations

import argparse
import bisect
import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from src.profiling.categories import classify_op

CATEGORIES = ("gemm", "attention", "norm_elementwise_cast", "optimizer", "fsdp_copy", "communication", "other")
LABELS = {
    "gemm": "GEMM", "attention": "attention", "norm_elementwise_cast": "norm/elementwise/cast", "optimizer": "optimizer",
    "fsdp_copy": "FSDP2 copy-in/out", "communication": "communication (all)", "other": "other",
}
# FSDP2's own work by name, for what runs outside its record_function ranges: the all-gather's
# copy-out (split_with_sizes_copy), the reduce-scatter's copy-in (_chunk_cat), and on a CPU its
# post-backward autograd node
_FSDP_KERNELS = re.compile(r"chunk_cat|split_with_sizes_copy|RegisterPostBackwardFunction", re.I)
# torch.cat / torch.stack: FSDP2's inside its ranges, the model's outside them (eager attention's
# dq, dk, dv stacked into in_proj's gradient, which this table once counted as FSDP2's)
_CAT = re.compile(r"CatArrayBatchedCopy|^aten::(cat|stack)$")
_COMM_OPS = re.compile(r"_c10d_functional::|wait_tensor")
# aten's pointwise ops by name on a CPU trace (categories.py names kernels, whose names differ)
_ATEN_POINTWISE = re.compile(r"^aten::(add|sub|mul|div|pow|neg|exp|log|rsqrt|sqrt|silu|clamp|where|fill|zero|copy|to|_to_copy|clone|lerp|addcmul|addcdiv)_?$")
# Inductor's fused pointwise / reduction / persistent-reduction kernels (kernels=compile)
_TRITON_FUSED = re.compile(r"^triton_(poi|red|per)_")
_MERGED = {"norm": "norm_elementwise_cast", "softmax": "norm_elementwise_cast", "elementwise": "norm_elementwise_cast",
           "loss": "norm_elementwise_cast", "reduction": "norm_elementwise_cast", "gather": "norm_elementwise_cast"}
DEVICE_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}
COMM_RANGE = re.compile(r"^(gloo|nccl):")  # the process group's collective, a range on its own thread


def category(name: str, in_fsdp: bool = False, in_optimizer: bool = False) -> str:
    """The anatomy category of a kernel or op; `in_fsdp` / `in_optimizer`: launched inside one of
    FSDP2's ranges (FSDP::all_gather, ...) or inside optimizer.step / zero_grad."""
    cat = classify_op(name)[1]
    if cat == "communication" or _COMM_OPS.search(name):
        return "communication"
    if in_fsdp or _FSDP_KERNELS.search(name):
        return "fsdp_copy"
    if in_optimizer:
        return "optimizer"
    if cat == "other" and (_TRITON_FUSED.search(name) or _ATEN_POINTWISE.search(name) or _CAT.search(name)):
        return "norm_elementwise_cast"
    return _MERGED.get(cat, cat)


# ---- interval arithmetic on one timeline (microseconds) ----

def merge(intervals: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """The union of [start, end) intervals as sorted, disjoint intervals."""
    out: list[list[float]] = []
    for start, end in sorted(intervals):
        if end <= start:
            continue
        if out and start <= out[-1][1]:
            out[-1][1] = max(out[-1][1], end)
        else:
            out.append([start, end])
    return [(s, e) for s, e in out]


def length(merged: list[tuple[float, float]]) -> float:
    return sum(e - s for s, e in merged)


def overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Time covered by both of two merged interval lists (a two-pointer sweep)."""
    i = j = 0
    both = 0.0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        both += max(0.0, hi - lo)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return both


def _inside(merged: list[tuple[float, float]], t: float) -> bool:
    k = bisect.bisect_right(merged, (t, float("inf"))) - 1
    return k >= 0 and merged[k][0] <= t < merged[k][1]


@dataclass
class Kernel:
    name: str
    ts: float
    """start, microseconds"""
    dur: float
    stream: int = 0
    category: str = ""
    launched: float | None = None
    """when the host's launch call (cudaLaunchKernel, cuLaunchKernelEx, cudaMemcpyAsync) returned, microseconds; None: not in the trace"""
    launch_tid: Any = None
    """the host thread that launched it"""


HOST_CATS = {"cpu_op", "user_annotation", "python_function", "cuda_runtime", "cuda_driver"}
NO_OP = "(no op traced)"
TOP_HOST_OPS = 3  # the ops named for a gap: the one that holds it and the one or two beside


class HostThread:
    """One host thread's traced events (ops, ranges, runtime calls), well nested, for asking what it
    did in a window."""

    def __init__(self, events: list[dict]):
        self.events = sorted(events, key=lambda e: (e["ts"], -e["dur"]))
        self.starts = [e["ts"] for e in self.events]
        # an event that overlaps a window starts at most this long before it
        self.longest = max((e["dur"] for e in self.events), default=0.0)

    def activity(self, start: float, end: float, top: int = TOP_HOST_OPS) -> list[dict[str, Any]]:
        """Per name, self time inside [start, end) (an event's time there less its children's), ms,
        the most first; time under no event is NO_OP."""
        lo = bisect.bisect_left(self.starts, start - self.longest)
        hi = bisect.bisect_left(self.starts, end)
        spans = [e for e in self.events[lo:hi] if e["ts"] + e["dur"] > start]
        by_name: dict[str, float] = defaultdict(float)
        for e, us in zip(spans, _self_times(spans, start, end)):
            by_name[e["name"]] += us
        uncovered = end - start - length(merge((max(start, e["ts"]), min(end, e["ts"] + e["dur"])) for e in spans))
        if uncovered > 0:
            by_name[NO_OP] += uncovered
        return [{"op": name, "ms": us * 1e-3} for name, us in sorted(by_name.items(), key=lambda kv: -kv[1])[:top] if us > 0]


TOP_PER_CATEGORY = 5  # enough to name what a category is made of; the full list is key_averages.txt
TOP_GAPS = 8  # the idle stretches listed: a block's repeating gap shows once, with its count a step


def kernel_family(name: str) -> str:
    """A kernel's name without its call's argument list (and without `(anonymous namespace)::`), so
    the launches of one kernel group together and two instantiations of a template stay apart."""
    name = name.replace("(anonymous namespace)::", "")
    depth = 0
    for i, ch in enumerate(name):
        if ch == "(" and depth == 0:
            return name[:i].strip()
        depth += (ch == "<") - (ch == ">")
    return name.strip()


def short_kernel_name(family: str, width: int = 110) -> str:
    """For the table: templates kept one level deep, so an elementwise kernel still shows its functor
    (`vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<>, std::array<> >`), cut to `width`."""
    out, depth = [], 0
    for ch in family:
        depth -= ch == ">"
        if depth <= 1:
            out.append(ch)
        depth += ch == "<"
    short = "".join(out)
    return short if len(short) <= width else short[: width - 3] + "..."


def top_kernels(kernels: list[Kernel], steps: int, per_category: int = TOP_PER_CATEGORY) -> dict[str, list[dict[str, Any]]]:
    """Per category, its longest kernel families: ms and launches per step, longest first."""
    time: dict[tuple[str, str], float] = defaultdict(float)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    for k in kernels:
        key = (k.category, kernel_family(k.name))
        time[key] += k.dur
        calls[key] += 1
    out: dict[str, list[dict[str, Any]]] = {}
    for (cat, name), us in sorted(time.items(), key=lambda kv: -kv[1]):
        rows = out.setdefault(cat, [])
        if len(rows) < per_category:
            rows.append({"kernel": name, "ms": us * 1e-3 / steps, "calls": calls[cat, name] / steps})
    return out


def idle_gaps(kernels: list[Kernel], busy: list[tuple[float, float]], steps: int, top: int = TOP_GAPS,
              host: dict[Any, HostThread] | None = None) -> dict[str, Any]:
    """The idle time between busy stretches, split by what ended each gap (see the module's
    docstring), ms a step: `host_ms` where the next kernel's launch returned after the device went
    idle, `queued_ms` where it had been launched before, `unknown_ms` where its launch is not in the
    trace; and the longest gaps grouped by (cause, kernel before, kernel after), per step, each
    group with its longest single gap and, for a host-late group whose launching thread is in
    `host`, that thread's activity from the device going idle to the launch (`host_in_longest`)."""
    starts = sorted(kernels, key=lambda k: k.ts)
    ends = sorted(kernels, key=lambda k: k.ts + k.dur)
    start_ts = [k.ts for k in starts]
    end_ts = [k.ts + k.dur for k in ends]
    split = {"host": 0.0, "queued": 0.0, "unknown": 0.0}
    groups: dict[tuple[str, str, str], list[Any]] = defaultdict(lambda: [0.0, 0, 0.0, None])  # us, gaps, the longest one, its host window
    for (_, gap_start), (gap_end, _) in zip(busy, busy[1:]):
        after = starts[bisect.bisect_left(start_ts, gap_end)]
        before = ends[bisect.bisect_right(end_ts, gap_start) - 1]
        cause = "unknown" if after.launched is None else "host" if after.launched > gap_start else "queued"
        split[cause] += gap_end - gap_start
        g = groups[cause, kernel_family(before.name), kernel_family(after.name)]
        g[0] += gap_end - gap_start
        g[1] += 1
        if gap_end - gap_start > g[2]:
            g[2] = gap_end - gap_start
            g[3] = (after.launch_tid, gap_start, after.launched) if cause == "host" else None
    longest = sorted(groups.items(), key=lambda kv: -kv[1][0])[:top]

    def host_in(window: tuple[Any, float, float] | None) -> dict[str, Any]:
        if window is None or host is None or window[0] not in host:
            return {}
        tid, start, end = window
        return {"host_in_longest": host[tid].activity(start, end)}

    return {
        "host_ms": split["host"] * 1e-3 / steps, "queued_ms": split["queued"] * 1e-3 / steps, "unknown_ms": split["unknown"] * 1e-3 / steps,
        # `max_ms`: the group's longest single gap, which tells a one-off (a compile, a first
        # allocation in the profiled window) from a gap every step pays
        "longest": [{"cause": c, "before": b, "after": a, "ms": us * 1e-3 / steps, "count": n / steps, "max_ms": most * 1e-3, **host_in(window)}
                    for (c, b, a), (us, n, most, window) in longest],
    }


def device_anatomy(kernels: list[Kernel], steps: int, host: dict[Any, HostThread] | None = None) -> dict[str, Any]:
    """Per-step device figures from one device's kernels (each with its category set); `host`: the
    trace's host threads, to say what the host did in the longest host-late gaps."""
    steps = max(steps, 1)
    by_cat: dict[str, float] = defaultdict(float)
    for k in kernels:
        by_cat[k.category] += k.dur
    comm = merge((k.ts, k.ts + k.dur) for k in kernels if k.category == "communication")
    compute = merge((k.ts, k.ts + k.dur) for k in kernels if k.category != "communication")
    busy = merge((k.ts, k.ts + k.dur) for k in kernels)
    window = (busy[-1][1] - busy[0][0]) if busy else 0.0
    ms = 1e-3 / steps
    return {
        "categories_ms": {c: by_cat.get(c, 0.0) * ms for c in CATEGORIES},
        "communication_exposed_ms": (length(comm) - overlap(comm, compute)) * ms,
        "idle_ms": (window - length(busy)) * ms,
        "idle": idle_gaps(kernels, busy, steps, host=host),
        "busy_ms": length(busy) * ms,
        "step_ms": window * ms,
        "top_kernels": top_kernels(kernels, steps),
    }


def steps_work(kernels: list[Kernel], in_steps: list[tuple[float, float]]) -> list[Kernel]:
    """The kernels the profiled steps launched: those whose launch call returned inside a ProfilerStep
    range (`in_steps`, merged), and those whose launch is not in the trace if they start and end inside
    the span of the first set on the device. A device behind its host (blocks replayed from CUDA
    graphs, where the host queues well ahead) runs the tail of the step before the window inside it,
    and the last step's tail after it: counting every kernel in the trace, +exp=fsdp4_fp8's profile
    read one AdamW update more than it had steps, and a step time to match."""
    inside = [k.launched is not None and _inside(in_steps, k.launched) for k in kernels]
    ours = [k for k, mine in zip(kernels, inside) if mine]
    if not ours:
        return kernels  # no step ranges, or no launches traced: every kernel, as recorded
    start, end = min(k.ts for k in ours), max(k.ts + k.dur for k in ours)
    return [k for k, mine in zip(kernels, inside) if mine or (k.launched is None and start <= k.ts and k.ts + k.dur <= end)]


def _self_times(ops: list[dict], start: float = -math.inf, end: float = math.inf) -> list[float]:
    """Self time of each op on one thread inside [start, end) (all of it by default): its time there
    less its direct children's."""
    windowed = math.isfinite(start) or math.isfinite(end)  # unwindowed: the durations as traced, not ts + dur - ts
    clip = [min(end, op["ts"] + op["dur"]) - max(start, op["ts"]) if windowed else op["dur"] for op in ops]
    order = sorted(range(len(ops)), key=lambda i: (ops[i]["ts"], -ops[i]["dur"]))
    own = [float(c) for c in clip]
    stack: list[int] = []
    for i in order:
        while stack and ops[i]["ts"] >= ops[stack[-1]]["ts"] + ops[stack[-1]]["dur"]:
            stack.pop()
        if stack:
            own[stack[-1]] -= clip[i]
        stack.append(i)
    return [max(0.0, t) for t in own]


def _ranges(events: list[dict], pattern: re.Pattern) -> dict[Any, list[tuple[float, float]]]:
    by_tid: dict[Any, list] = defaultdict(list)
    for e in events:
        if e.get("cat") == "user_annotation" and pattern.search(e.get("name", "")):
            by_tid[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
    return {tid: merge(v) for tid, v in by_tid.items()}


def anatomy_from_trace(trace: dict, flops_per_step: float | None = None, gemm_peak_tflops: float = 790.0) -> dict[str, Any]:
    """The step anatomy of one rank's Chrome trace (torch.profiler's export_chrome_trace)."""
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    step_spans = [e for e in events if e.get("cat") == "user_annotation" and e["name"].startswith("ProfilerStep#")]
    steps = len({e["name"] for e in step_spans}) or 1
    fsdp = _ranges(events, re.compile(r"^FSDP::"))
    optim = _ranges(events, re.compile(r"^Optimizer\.(step|zero_grad)#"))
    device = [e for e in events if str(e.get("cat", "")).lower() in DEVICE_CATS]
    out: dict[str, Any] = {"profiled_steps": steps}
    if device:
        launches = {e["args"]["correlation"]: e for e in events
                    if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})}
        devices = defaultdict(int)
        for e in device:
            devices[e.get("args", {}).get("device")] += 1
        mine = max(devices, key=devices.get)  # a rank's own GPU; a stray event of another is left out
        kernels = []
        for e in device:
            args = e.get("args", {})
            if args.get("device") != mine:
                continue
            launch = launches.get(args.get("correlation"))
            tid, ts = (launch["tid"], launch["ts"]) if launch is not None else (None, 0.0)
            kernels.append(Kernel(e["name"], e["ts"], e["dur"], args.get("stream", 0),
                                  category(e["name"], _inside(fsdp.get(tid, []), ts), _inside(optim.get(tid, []), ts)),
                                  launched=launch["ts"] + launch["dur"] if launch is not None else None, launch_tid=tid))
        in_steps = merge((e["ts"], e["ts"] + e["dur"]) for e in step_spans)
        threads: dict[Any, list[dict]] = defaultdict(list)
        for e in events:
            if e.get("cat") in HOST_CATS:
                threads[e["tid"]].append(e)
        host = {tid: HostThread(v) for tid, v in threads.items()}
        out.update(source="device kernels", **device_anatomy(steps_work(kernels, in_steps), steps, host))
    else:
        comm = _ranges(events, COMM_RANGE)
        by_cat: dict[str, float] = defaultdict(float)
        by_tid: dict[Any, list] = defaultdict(list)
        for e in events:
            if e.get("cat") == "cpu_op":
                by_tid[e["tid"]].append(e)
        for tid, ops in by_tid.items():
            for op, own in zip(ops, _self_times(ops)):
                if not _inside(comm.get(tid, []), op["ts"]):  # ops of a collective count as communication
                    by_cat[category(op["name"], _inside(fsdp.get(tid, []), op["ts"]), _inside(optim.get(tid, []), op["ts"]))] += own
        by_cat["communication"] += sum(length(v) for v in comm.values())
        ms = 1e-3 / steps
        out.update(
            source="cpu ops (self time)",
            note="no device kernels in this trace (a CPU run): categories are CPU-op self time; exposed communication, idle and the GEMM floor are device figures, absent",
            categories_ms={c: by_cat.get(c, 0.0) * ms for c in CATEGORIES},
            communication_exposed_ms=None, idle_ms=None, busy_ms=None,
            step_ms=sum(e["dur"] for e in step_spans) * 1e-3 / steps if step_spans else None,
        )
    out["gemm_peak_tflops"] = gemm_peak_tflops
    out["model_flops_per_step"] = flops_per_step
    # a GPU's GEMM rate says nothing of a CPU run: the floor is a device figure
    floor = flops_per_step / (gemm_peak_tflops * 1e12) * 1e3 if (device and flops_per_step and gemm_peak_tflops > 0) else None
    out["gemm_floor_ms"] = floor
    out["step_over_floor"] = out["step_ms"] / floor if floor and out.get("step_ms") else None
    return out


def format_table(a: dict[str, Any]) -> str:
    """The anatomy as a text table: ms per step and share of the step."""
    step = a.get("step_ms")

    def row(label: str, ms: float | None) -> str:
        share = f"{100 * ms / step:7.1f}" if (ms is not None and step) else "      -"
        return f"{label:<28} {'n/a' if ms is None else f'{ms:9.2f}':>9} {share}"

    lines = [f"step anatomy: {a['profiled_steps']} profiled steps, {a['source']}; ms per step", f"{'':<28} {'ms':>9} {'% step':>7}"]
    lines += [row(LABELS[c], a["categories_ms"][c]) for c in CATEGORIES]
    lines += [row("  communication exposed", a["communication_exposed_ms"]), row("idle (no kernel)", a["idle_ms"])]
    idle = a.get("idle")
    if idle:
        lines += [row("  host late", idle["host_ms"]), row("  queued (not on a kernel)", idle["queued_ms"])]
        if idle["unknown_ms"]:
            lines.append(row("  launch not traced", idle["unknown_ms"]))
    lines.append(row("step" + (" (device)" if a["idle_ms"] is not None else " (CPU)"), step))
    if a["gemm_floor_ms"] is not None:
        ratio = f"   step = {a['step_over_floor']:.2f}x floor" if a["step_over_floor"] else ""
        lines.append(row(f"GEMM floor @{a['gemm_peak_tflops']:g} TFLOP/s", a["gemm_floor_ms"]) + ratio)
    if a.get("note"):
        lines.append(a["note"])
    top = a.get("top_kernels") or {}
    if top:  # what each category is made of (device traces only)
        lines.append("longest kernels per category: ms and launches per step")
        for c in CATEGORIES:
            for i, k in enumerate(top.get(c, [])):
                lines.append(f"  {LABELS[c] if i == 0 else '':<26} {k['ms']:9.2f} {k['calls']:7.1f}x  {short_kernel_name(k['kernel'])}")
    if idle and idle["longest"]:
        lines.append("longest idle gaps: ms and gaps per step, the longest one, what ended them, the kernels before -> after")
        for g in idle["longest"]:
            lines.append(f"  {g['ms']:9.2f} {g['count']:7.1f}x  max {g['max_ms']:8.2f}  {g['cause']:<7} "
                         f"{short_kernel_name(g['before'], 60)} -> {short_kernel_name(g['after'], 60)}")
            if g.get("host_in_longest"):
                ops = ", ".join(f"{short_kernel_name(h['op'], 60)} {h['ms']:.2f}" for h in g["host_in_longest"])
                lines.append(f"  {'':<35}host in the longest (ms): {ops}")
    return "\n".join(lines)


def metrics(a: dict[str, Any]) -> dict[str, float]:
    """Flat numeric figures for MLflow (`anatomy.gemm_ms`, `anatomy.idle_ms`, ...)."""
    flat = {f"anatomy.{c}_ms": v for c, v in a["categories_ms"].items()}
    for key in ("communication_exposed_ms", "idle_ms", "step_ms", "gemm_floor_ms", "step_over_floor"):
        if a.get(key) is not None:
            flat[f"anatomy.{key}"] = a[key]
    if a.get("idle"):
        flat["anatomy.idle_host_late_ms"], flat["anatomy.idle_queued_ms"] = a["idle"]["host_ms"], a["idle"]["queued_ms"]
    return flat


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("trace", type=Path, help="a Chrome trace from task=profile (profile/trace_rank0.json)")
    ap.add_argument("--flops-per-step", type=float, default=None, help="model FLOPs per step per device (summary.json: flops_per_token x batch x seq_len)")
    ap.add_argument("--peak-tflops", type=float, default=790.0, help="the GEMM floor's rate")
    ap.add_argument("--out", type=Path, default=None, help="write anatomy.json here")
    args = ap.parse_args()
    a = anatomy_from_trace(json.loads(args.trace.read_text()), args.flops_per_step, args.peak_tflops)
    print(format_table(a))
    if args.out:
        args.out.write_text(json.dumps(a, indent=2))


if __name__ == "__main__":
    main()
