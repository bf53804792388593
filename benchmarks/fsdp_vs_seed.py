"""docs/SEED.md's FSDP2 script beside named variants of `python -m src.run +exp=fsdp4`, run alternately
in one call on the same GPUs, so every ratio is measured side by side.

    python -m benchmarks.fsdp_vs_seed --nproc 2 --steps 30 --rounds 3 --seed-compile --budget-s 540 \\
        --variant eager= --variant compile="kernels=compile" --variant fp8="precision=fp8 kernels=compile" \\
        --variant foreach="optim.impl=foreach" --out bench_out/levers

Each round runs, for each GPU count, the seed's script (and with --seed-compile its per-block
torch.compile), then every variant: NAME=OVERRIDES, the overrides added to +exp=fsdp4 (empty: the
experiment as it is; `+exp=NAME` runs that experiment instead, e.g. tuned="+exp=fsdp4_tuned";
`tracking=mlflow` tracks into OUT/mlflow.db), where an upper-case KEY=VALUE is
an environment variable of that run instead (NCCL_ALGO=Tree, PYTORCH_CUDA_ALLOC_CONF=..., the
communication knobs that live outside the config). A run that fails is recorded
with its error and the call goes on. rows.json is rewritten after every run, so a call cut off
keeps what ran; past --budget-s no new run starts (nor one that the longest run so far would
carry past it). At the end, one median row per (impl, GPUs): tokens/s per GPU, MFU, peak memory
(rank 0, as the seed prints it), step time, host time to queue a step (near the step time, the
host is the limit), host memory growth after the warm-up steps (rank 0),
and the ratio to the seed. Both sides take the median step over steps >= --warmup.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import time
from pathlib import Path

SEED_SCRIPT = Path(__file__).with_name("seed_fsdp.py")
ENV_VAR = re.compile(r"^[A-Z][A-Z0-9_]*=")
FIGURES = ("tokens_per_s_per_device", "mfu", "peak_mem_gb", "step_time_s", "host_step_time_s", "final_loss", "host_rss_growth_mb",
           # speed.cudagraphs runs: graphs held, recorded again (a weight moved), run launched instead
           "cudagraphs", "cudagraph_rerecords", "cudagraph_skips",
           # rank 0's GPU over the timed steps: runs compare fairly at the same clock, and a step at its
           # power cap runs at a lower one (src/profiling/gpu_clocks.py); the seed's script does not sample
           "gpu_sm_clock_mhz", "gpu_power_w", "gpu_power_capped_frac")


def split_named(text: str) -> tuple[str, list[str] | None]:
    """'fp8=precision=fp8 kernels=compile' -> ('fp8', ['precision=fp8', 'kernels=compile']); with no '=',
    (text, None). The benches that take NAME=OVERRIDES share this split and check the parts each their own way."""
    name, sep, overrides = text.partition("=")
    return name, (shlex.split(overrides) if sep else None)


def parse_variant(text: str) -> tuple[str, list[str]]:
    """'fp8=precision=fp8 kernels=compile' -> ('fp8', ['precision=fp8', 'kernels=compile'])."""
    name, overrides = split_named(text)
    if overrides is None or not name or name.startswith("seed"):
        raise argparse.ArgumentTypeError(f"--variant {text!r}: give NAME=OVERRIDES (NAME not starting with 'seed'), e.g. compile=\"kernels=compile\"")
    return name, overrides


def _tail(proc: subprocess.CompletedProcess) -> str:
    lines = (proc.stderr or proc.stdout or "").strip().splitlines()
    errors = [line for line in lines if line.startswith("error:") or "Error" in line]
    return (errors[-1] if errors else (lines[-1] if lines else f"exit code {proc.returncode}"))[:500]


def run_seed(nproc: int, args: argparse.Namespace, compile_blocks: bool, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SEED_SCRIPT),
           "--steps", str(args.steps), "--warmup", str(args.warmup), *(["--compile"] if compile_blocks else [])]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    line = next((ln for ln in proc.stdout.splitlines() if ln.startswith("SEED_RESULT ")), None)
    if proc.returncode or line is None:
        return {"error": _tail(proc)}
    return json.loads(line.split(" ", 1)[1])


def run_ours(nproc: int, args: argparse.Namespace, overrides: list[str], run_dir: Path, timeout: float) -> dict:
    # a variant may name its own experiment (tuned=+exp=fsdp4_tuned): it replaces fsdp4
    exp = next((o for o in overrides if o.startswith("+exp=")), "+exp=fsdp4")
    overrides = [o for o in overrides if o != exp]
    cmd = [sys.executable, "-m", "src.run", exp, f"dist.nproc={nproc}", f"train.steps={args.steps}",
           f"train.untimed_steps={args.warmup}", "train.progress=false", "tracking=none",
           f"hydra.run.dir={run_dir}", *overrides]
    env = dict(os.environ, **dict(o.split("=", 1) for o in overrides if ENV_VAR.match(o)))
    cmd = [c for c in cmd if not ENV_VAR.match(c)]
    if "tracking=mlflow" in overrides:
        cmd.append(f"tracking.uri=sqlite:///{(args.out / 'mlflow.db').resolve()}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    summary_file = run_dir / "summary.json"
    if proc.returncode or not summary_file.exists():
        return {"error": _tail(proc)}
    s = json.loads(summary_file.read_text())
    return {k: s.get(k) for k in FIGURES}


def _median(rows: list[dict], key: str) -> float | None:
    vals = [r[key] for r in rows if r.get(key) is not None]
    return statistics.median(vals) if vals else None


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: list[dict], impls: list[str], nprocs: list[int]) -> str:
    head = (f"{'impl':<14} {'GPUs':>4} {'tok/s/GPU':>11} {'MFU %':>6} {'peak GB':>8} {'step ms':>8} {'host ms':>8} {'SM MHz':>7} {'RSS +MB':>8} "
            f"{'vs seed':>8} {'runs':>5}")
    out = [head]
    for n in nprocs:
        base = _median([r for r in rows if r["impl"] == "seed" and r["nproc"] == n and "error" not in r], "tokens_per_s_per_device")
        for impl in impls:
            sel = [r for r in rows if r["impl"] == impl and r["nproc"] == n]
            ok = [r for r in sel if "error" not in r]
            if not sel:
                continue
            if not ok:
                out.append(f"{impl:<14} {n:>4} failed: {sel[-1]['error'][:70]}")
                continue
            tps = _median(ok, "tokens_per_s_per_device")
            peak = max((r["peak_mem_gb"] for r in ok if r.get("peak_mem_gb") is not None), default=None)
            step = _median(ok, "step_time_s")
            host = _median(ok, "host_step_time_s")
            ratio = f"{tps / base:>7.3f}x" if (base and tps) else f"{'n/a':>8}"
            out.append(f"{impl:<14} {n:>4} {_fmt(tps, ',.0f'):>11} {_fmt(_median(ok, 'mfu'), '.1f'):>6} {_fmt(peak, '.2f'):>8} "
                       f"{_fmt(step and 1e3 * step, '.1f'):>8} {_fmt(host and 1e3 * host, '.1f'):>8} {_fmt(_median(ok, 'gpu_sm_clock_mhz'), '.0f'):>7} "
                       f"{_fmt(_median(ok, 'host_rss_growth_mb'), '+.1f'):>8} {ratio} {len(ok):>3}/{len(sel)}")
    return "\n".join(out)


def main(argv: list[str] | None = None, clock=time.monotonic) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3, help="steps left out of the medians (compilation, allocator warm-up)")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variant", type=parse_variant, action="append", default=None,
                    help="NAME=OVERRIDES for +exp=fsdp4, repeatable (default: ours=, the experiment as it is)")
    ap.add_argument("--seed-compile", action="store_true", help="also the seed's script with torch.compile per block")
    ap.add_argument("--no-seed", action="store_true", help="leave the seed's script out (ratios then show n/a)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no run past this many seconds of wall time")
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    args = ap.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    variants = args.variant or [("ours", [])]
    if len({name for name, _ in variants}) != len(variants):
        ap.error("--variant names must differ")
    seeds = [] if args.no_seed else ["seed"] + (["seed+compile"] if args.seed_compile else [])
    impls = seeds + [name for name, _ in variants]

    rows: list[dict] = []
    t0, longest, stopped = clock(), 0.0, False
    for r in range(args.rounds):
        for n in args.nproc:
            for impl in impls:
                elapsed = clock() - t0
                if elapsed + longest > args.budget_s:
                    stopped = True
                    break
                start = clock()
                timeout = max(args.budget_s - elapsed, 1.0) if args.budget_s != float("inf") else None
                try:
                    if impl.startswith("seed"):
                        figures = run_seed(n, args, impl == "seed+compile", timeout)
                    else:
                        overrides = dict(variants)[impl]
                        figures = run_ours(n, args, overrides, args.out / f"{impl}-n{n}-r{r}", timeout)
                except subprocess.TimeoutExpired:
                    figures = {"error": f"cut off at --budget-s {args.budget_s:g}"}
                took = clock() - start
                longest = max(longest, took)
                rows.append({"impl": impl, "nproc": n, "round": r, "wall_s": took, **figures})
                (args.out / "rows.json").write_text(json.dumps(rows, indent=2))  # after every run: a cut-off call keeps what ran
                what = figures.get("error") or (f"{figures['tokens_per_s_per_device']:,.0f} tok/s/GPU, MFU {_fmt(figures.get('mfu'), '.1f')}%, "
                                                f"step {1e3 * figures['step_time_s']:.1f} ms")
                if figures.get("gpu_sm_clock_mhz") is not None:
                    what += (f", SM {figures['gpu_sm_clock_mhz']:.0f} MHz at {figures['gpu_power_w']:.0f} W"
                             f" (power cap {100 * figures['gpu_power_capped_frac']:.0f}% of samples)")
                if figures.get("cudagraphs") is not None:
                    what += f", {figures['cudagraphs']} CUDA graphs ({figures['cudagraph_rerecords']} re-recorded, {figures['cudagraph_skips']} skipped)"
                print(f"{impl:<14} nproc={n} round={r} ({took:.0f} s): {what}", flush=True)
            if stopped:
                break
        if stopped:
            print(f"--budget-s {args.budget_s:g}: no new run after {clock() - t0:.0f} s ({len(rows)} runs)", flush=True)
            break
    print()
    print(table(rows, impls, args.nproc))
    (args.out / "table.txt").write_text(table(rows, impls, args.nproc) + "\n")
    return rows


if __name__ == "__main__":
    main()
