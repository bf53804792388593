"""task=kernel_bench (`+exp=kernels`): each op x shape x mode x variant timed side by side in one
process, checked against eager, and reported as median time, effective TB/s, share of the copy
ceiling measured in the same run, speedup over eager, and peak memory; printed as a table,
written to kernel_bench.{csv,md,png} and summary.json, and logged to MLflow."""
from __future__ import annotations

import csv
import logging
import math
from pathlib import Path
from typing import Any

import torch
from omegaconf import DictConfig

from src.dtypes import torch_dtype
from src.fusion.cases import (
    GRADIENT_IN_FORWARD,
    Case,
    forward_backward,
    make_case,
    max_rel_err,
    output_of,
    seed,
    variant,
)
from src.fusion.timing import chain_ms, copy_ceiling_tbs, graph_ms, host_us_per_call, median_ms, peak_mb
from src.runtime import RunContext

log = logging.getLogger("src.run")

COLUMNS = ["op", "shape", "mode", "provider", "ms", "host_us", "graph_ms", "chain_ms", "tbs", "graph_tbs", "chain_tbs", "pct_ceiling", "tflops", "speedup", "graph_speedup", "peak_mb", "max_rel_err"]


def _device(cfg: DictConfig) -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if cfg.backend.name == "cuda" else torch.device("cpu")


def _measure(case: Case, provider: str, mode: str, device: torch.device, dtype: torch.dtype, bench: DictConfig, reference: Any, base_inputs: list[torch.Tensor]) -> dict | None:
    if mode == "bwd" and provider == "compile":
        # the backward alone runs one compiled backward again and again (retain_graph), which
        # AOTAutograd refuses where its backward reuses ("donates") saved buffers for its outputs:
        # compiled afresh without donation, the same kernels in memory of their own
        torch._dynamo.reset()
        try:
            with torch._functorch.config.patch(donated_buffer=False):
                return _measure_variant(case, provider, mode, device, dtype, bench, reference, base_inputs)
        finally:
            torch._dynamo.reset()
    return _measure_variant(case, provider, mode, device, dtype, bench, reference, base_inputs)


def _measure_variant(case: Case, provider: str, mode: str, device: torch.device, dtype: torch.dtype, bench: DictConfig, reference: Any,
                     base_inputs: list[torch.Tensor]) -> dict | None:
    fn = variant(case.op, provider)
    if fn is None:
        return None
    grad = mode in ("fwd_bwd", "bwd")

    def make_inputs() -> list[torch.Tensor]:
        return [t.detach().clone().requires_grad_(grad and t.is_floating_point()) for t in base_inputs]

    def make_run(inputs: list[torch.Tensor], first=None):
        if grad:
            return forward_backward(fn, inputs, first, backward_only=mode == "bwd")

        def run():
            with torch.no_grad():
                fn(*inputs)
        return run

    inputs = make_inputs()
    leaves = [t for t in inputs if t.requires_grad]
    first = fn(*inputs)
    err = max_rel_err(output_of(first), reference) if reference is not None else 0.0
    run = make_run(inputs, first)
    del first
    ms = median_ms(run, device, bench.warmup_ms, bench.rep_ms, leaves)
    for t in leaves:
        t.grad = None
    peak = peak_mb(run, device)
    host = host_us_per_call(run, device)
    try:
        replayed = graph_ms(run, device, bench.warmup_ms, bench.rep_ms, leaves)
    except Exception as capture_error:  # a variant that syncs with the host (Liger's CE reads its count) cannot be captured
        why = str(capture_error).splitlines()[0] if str(capture_error) else type(capture_error).__name__
        log.info("%s %s %s %s: not capturable in a CUDA graph (%s)", case.op, list(case.shape), mode, provider, why)
        replayed = None
    size = torch.finfo(dtype).bits // 8
    forward = mode != "bwd"
    nbytes = (case.bytes_fwd(size) if forward else 0) + (case.bytes_bwd(size) if grad else 0)
    flops = (case.flops_fwd if forward else 0) + (case.flops_bwd if grad else 0)
    chained = None
    if replayed is not None and bench.chain and not flops:  # a chain is about L2 and bytes; GEMM rows are about FLOPs
        try:
            chained = chain_ms(lambda: make_run(make_inputs()), device, nbytes, bench.rep_ms)
        except torch.OutOfMemoryError:  # 4-32 input sets at once: the row keeps its other timings
            log.info("%s %s %s %s: no chain ms (out of memory for its input sets)", case.op, list(case.shape), mode, provider)
            torch.cuda.empty_cache()

    def rate(t_ms: float | None, amount: int) -> float | None:
        return None if t_ms is None or not amount else amount / (t_ms * 1e-3) / 1e12

    return {
        "op": case.op, "shape": "x".join(map(str, case.shape)), "mode": mode, "provider": provider, "ms": ms,
        "host_us": host, "graph_ms": replayed, "chain_ms": chained,
        "tbs": None if flops else rate(ms, nbytes), "graph_tbs": None if flops else rate(replayed, nbytes),
        "chain_tbs": None if flops else rate(chained, nbytes),
        "tflops": rate(ms, flops) if flops else None,
        "peak_mb": peak, "max_rel_err": err,
    }


def run_bench(cfg: DictConfig) -> tuple[list[dict], float | None, str]:
    bench = cfg.kernel_bench
    device = _device(cfg)
    dtype = torch_dtype(bench.dtype)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    # A ceiling to hold kernels to is a GPU's: on a CPU, Triton runs in its interpreter and a copy of
    # copy_mb through caches says nothing of it (eager ops read 2-7x "above" it)
    ceiling = copy_ceiling_tbs(device, int(bench.copy_mb * 2**20), bench.warmup_ms, bench.rep_ms) if device.type == "cuda" else None
    if ceiling is not None:
        log.info("copy ceiling on %s: %.2f TB/s (%d MB copied)", device_name, ceiling, bench.copy_mb)
    rows: list[dict] = []
    for op in bench.ops:
        for shape in bench.shapes[op]:
            case = make_case(op, list(shape))
            for mode in bench.modes:
                if mode == "bwd" and op in GRADIENT_IN_FORWARD:
                    log.info("%s %s bwd: no row (the fused variants compute the gradient in the forward)", op, list(case.shape))
                    continue
                seed(device)
                base_inputs = case.inputs(device, dtype, False)  # drawn once: each variant gets copies
                reference = output_of(variant(op, "eager")(*[t.clone() for t in base_inputs])).detach()
                group = []
                for provider in bench.providers:
                    try:
                        row = _measure(case, provider, mode, device, dtype, bench, reference, base_inputs)
                    except Exception as err:  # one variant failing (a Liger version, a compile error) does not end the table
                        log.error("%s %s %s %s failed: %s: %s", op, list(case.shape), mode, provider, type(err).__name__, str(err).splitlines()[0] if str(err) else "")
                        continue
                    if row is None:
                        log.info("%s %s %s: no %s variant (not installed, or none for this op)", op, list(case.shape), mode, provider)
                        continue
                    group.append(row)
                    log.info("%-21s %-14s %-7s %-8s %9.4f ms", op, row["shape"], mode, provider, row["ms"])
                eager = next((r for r in group if r["provider"] == "eager"), None)
                for row in group:
                    row["speedup"] = eager["ms"] / row["ms"] if eager else math.nan
                    row["graph_speedup"] = eager["graph_ms"] / row["graph_ms"] if eager and eager["graph_ms"] and row["graph_ms"] else None
                    best = row["graph_tbs"] or row["tbs"]  # the kernels' own bandwidth where a graph could replay them
                    row["pct_ceiling"] = 100 * best / ceiling if best is not None and ceiling else None
                rows.extend(group)
    return rows, ceiling, device_name


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return "n/a"
    return f"{value:.{digits}f}" if isinstance(value, float) else str(value)


def _times(ratio: float | None) -> str:
    text = _fmt(ratio)
    return text if text == "n/a" else f"{text}x"


def markdown_table(rows: list[dict], ceiling: float | None, device_name: str, dtype: str) -> str:
    how = "median of triton.testing.do_bench" if device_name != "cpu" else "wall-clock median on the CPU (Triton in its interpreter: not kernel times)"
    where = f"copy ceiling {ceiling:.2f} TB/s measured in the same run" if ceiling is not None else "no copy ceiling off a GPU"
    head = (f"{device_name}, {dtype}, {how}; {where}. "
            "`ms`: as called (host path included); `graph ms`: replayed from a CUDA graph (GPU time alone); "
            "`chain ms`: called on distinct inputs back to back from one graph, L2 as the previous call left it, as in a step; "
            "`host us`: CPU time to issue one call; TB/s and `% ceiling` from graph ms where there is one, chain TB/s from chain ms\n\n"
            "| op | shape | mode | variant | ms | graph ms | chain ms | host us | TB/s | chain TB/s | % ceiling | TFLOP/s | vs eager | vs eager (graph) | peak MB | max rel err |\n"
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    lines = [head]
    for r in rows:
        lines.append(
            f"| {r['op']} | {r['shape']} | {r['mode']} | {r['provider']} | {_fmt(r['ms'], 4)} | {_fmt(r.get('graph_ms'), 4)} | {_fmt(r.get('chain_ms'), 4)} | "
            f"{_fmt(r.get('host_us'), 1)} | {_fmt(r.get('graph_tbs') or r['tbs'])} | {_fmt(r.get('chain_tbs'))} | {_fmt(r['pct_ceiling'], 1)} | {_fmt(r['tflops'], 1)} | {_times(r['speedup'])} | "
            f"{_times(r.get('graph_speedup'))} | {_fmt(r['peak_mb'], 1)} | {_fmt(r['max_rel_err'], 4)} |"
        )
    return "\n".join(lines)


def bar_chart(rows: list[dict], ceiling: float | None, device_name: str, path: Path) -> None:
    """Effective TB/s per op, shape and mode, one bar per variant (replayed after do_bench's flush
    where capturable, as called otherwise), a black tick on it where the variant was also timed
    chained (as a step runs it), the copy ceiling as a line."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = list(dict.fromkeys((r["op"], r["shape"], r["mode"]) for r in rows if r["tbs"] is not None))
    providers = list(dict.fromkeys(r["provider"] for r in rows))
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(groups) + 2), 4.5))
    width = 0.8 / max(1, len(providers))
    tick_label = "chained over distinct inputs"  # on the first variant's ticks only: one legend entry
    for i, provider in enumerate(providers):
        values = [next((r.get("graph_tbs") or r["tbs"] for r in rows if (r["op"], r["shape"], r["mode"]) == g and r["provider"] == provider), 0.0) or 0.0 for g in groups]
        ax.bar([k + i * width for k in range(len(groups))], values, width, label=provider)
        chained = [(k + i * width, r["chain_tbs"]) for k, g in enumerate(groups) for r in rows
                   if (r["op"], r["shape"], r["mode"]) == g and r["provider"] == provider and r.get("chain_tbs")]
        if chained:
            ax.hlines([v for _, v in chained], [x - width / 2 for x, _ in chained], [x + width / 2 for x, _ in chained], colors="k", linewidth=2, label=tick_label)
            tick_label = None
    if ceiling is not None:
        ax.axhline(ceiling, color="k", linestyle="--", linewidth=1, label=f"copy ceiling {ceiling:.2f} TB/s")
    ax.set_xticks([k + width * (len(providers) - 1) / 2 for k in range(len(groups))])
    ax.set_xticklabels([f"{op}\n{shape}\n{mode}" for op, shape, mode in groups], fontsize=7)
    replayed = any(r.get("graph_tbs") for r in rows)  # off CUDA nothing is replayed: the bars are as called
    how = "bars replayed from a CUDA graph after do_bench's L2 flush" if replayed else "bars as called"
    if any(r.get("chain_tbs") for r in rows):
        how += ", ticks chained"
    ax.set_ylabel("effective TB/s")
    ax.set_title(f"fused kernels on {device_name}: {how}")
    tallest = max([ceiling or 0.0] + [v for r in rows for v in (r.get("graph_tbs") or r["tbs"], r.get("chain_tbs")) if v])
    ax.set_ylim(0, tallest * 1.2)  # headroom above everything drawn: the legend's one row goes there, clear of the bars
    ax.legend(fontsize=8, loc="upper left", ncol=len(providers) + 2)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run_kernel_bench(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """The bench in this process; src/tasks.py's one_shot has written config.yaml and opened run.log."""
    from src.tracking.mlflow_run import task_tracker, write_json

    run_dir = Path(ctx.run_dir)
    if cfg.backend.name == "cuda":
        torch.cuda.set_device(0)
    elif any(p in ("triton", "liger") for p in cfg.kernel_bench.providers):
        log.info("no GPU: Triton runs in its interpreter here, so these times check the plumbing, not the kernels")
    rows, ceiling, device_name = run_bench(cfg)
    table = markdown_table(rows, ceiling, device_name, cfg.kernel_bench.dtype)
    log.info("kernel bench:\n%s", table)
    (run_dir / "kernel_bench.md").write_text(table + "\n")
    with open(run_dir / "kernel_bench.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({k: r.get(k) for k in COLUMNS} for r in rows)
    bar_chart(rows, ceiling, device_name, run_dir / "kernel_bench.png")

    tracker = task_tracker(cfg, ctx, device_name)
    summary = {"task": "kernel_bench", "status": "finished", "device": device_name, "dtype": cfg.kernel_bench.dtype,
               "copy_ceiling_tbs": ceiling, "rows": rows, "mlflow_run_id": tracker.run_id}
    write_json(run_dir / "summary.json", summary)
    for name in ("kernel_bench.md", "kernel_bench.csv", "kernel_bench.png", "summary.json", "config.yaml", "run.log"):
        tracker.log_artifact(run_dir / name)
    metrics = {"copy_ceiling_tbs": ceiling} if ceiling is not None else {}
    for r in rows:
        key = f"{r['op']}.{r['shape']}.{r['mode']}.{r['provider']}"
        metrics[f"{key}.ms"] = r["ms"]
        metrics[f"{key}.speedup"] = r["speedup"]
        for name in ("tbs", "graph_ms", "graph_tbs", "chain_ms", "chain_tbs", "host_us"):
            if r.get(name) is not None:
                metrics[f"{key}.{name}"] = r[name]
    tracker.finish("FINISHED", metrics)
    return summary
