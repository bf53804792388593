"""SEED.md's FSDP2 script against `python -m src.run +exp=fsdp4`, run alternately in one call on the
same GPUs, so the ratio between them is measured side by side.

    python -m src.bench.fsdp_vs_seed --nproc 1 2 --steps 20 --rounds 2 --out bench_out

Prints one row per run and a median per (implementation, GPUs): tokens/s per GPU, MFU, peak memory
(rank 0, as the seed prints it), step time, and for ours the share of wall time spent on metrics
and logging. Both sides take the median step over steps >= --warmup.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

SEED_SCRIPT = Path(__file__).with_name("seed_fsdp.py")


def run_seed(nproc: int, steps: int, warmup: int) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", str(SEED_SCRIPT), "--steps", str(steps), "--warmup", str(warmup)]
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
    line = next(l for l in out.splitlines() if l.startswith("SEED_RESULT "))
    return json.loads(line.split(" ", 1)[1])


def run_ours(nproc: int, steps: int, warmup: int, run_dir: Path, tracking: str, extra: list[str]) -> dict:
    cmd = [
        sys.executable, "-m", "src.run", "+exp=fsdp4", f"dist.nproc={nproc}", f"train.steps={steps}",
        f"train.untimed_steps={warmup}", "train.progress=false", f"tracking={tracking}",
        f"hydra.run.dir={run_dir}", *extra,
    ]
    if tracking == "mlflow":
        cmd.append(f"tracking.uri=sqlite:///{run_dir.parent / 'mlflow.db'}")
    subprocess.run(cmd, capture_output=True, text=True, check=True)
    summary = json.loads((run_dir / "summary.json").read_text())
    return summary


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--nproc", type=int, nargs="+", default=[2])
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--out", type=Path, default=Path("bench_out"))
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for our runs")
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    rows = []
    for r in range(args.rounds):
        for n in args.nproc:
            seed = run_seed(n, args.steps, args.warmup)
            rows.append({"impl": "seed", "nproc": n, "round": r, **seed})
            print(f"seed   nproc={n} round={r}: {seed['tokens_per_s_per_device']:,.0f} tok/s/GPU", flush=True)
            for tracking in ("mlflow", "none"):
                s = run_ours(n, args.steps, args.warmup, args.out / f"ours-{tracking}-n{n}-r{r}", tracking, args.extra)
                rows.append({
                    "impl": f"ours/{tracking}", "nproc": n, "round": r,
                    "tokens_per_s_per_device": s["tokens_per_s_per_device"], "mfu": s["mfu"],
                    "peak_mem_gb": s["peak_mem_gb"], "step_time_s": s["step_time_s"],
                    "final_loss": s["final_loss"], "overhead_frac": s["overhead_frac"],
                })
                print(f"ours/{tracking} nproc={n} round={r}: {s['tokens_per_s_per_device']:,.0f} tok/s/GPU", flush=True)
            (args.out / "rows.json").write_text(json.dumps(rows, indent=2))  # after every pair: a cut-off call keeps what ran

    print(f"\n{'impl':<12} {'GPUs':>4} {'tok/s/GPU':>11} {'MFU %':>6} {'peak GB':>8} {'step ms':>8} {'overhead':>9} {'vs seed':>8}")
    for n in args.nproc:
        base = statistics.median(r["tokens_per_s_per_device"] for r in rows if r["impl"] == "seed" and r["nproc"] == n)
        for impl in ("seed", "ours/mlflow", "ours/none"):
            sel = [r for r in rows if r["impl"] == impl and r["nproc"] == n]
            tps = statistics.median(r["tokens_per_s_per_device"] for r in sel)
            mfu = statistics.median(r["mfu"] for r in sel) if sel[0]["mfu"] is not None else float("nan")
            mem = max(r["peak_mem_gb"] for r in sel)
            ms = 1e3 * statistics.median(r["step_time_s"] for r in sel)
            ovh = f"{100 * statistics.median(r['overhead_frac'] for r in sel):.2f}%" if "overhead_frac" in sel[0] else "-"
            print(f"{impl:<12} {n:>4} {tps:>11,.0f} {mfu:>6.1f} {mem:>8.2f} {ms:>8.1f} {ovh:>9} {tps / base:>7.3f}x")


if __name__ == "__main__":
    main()
