"""Per-step cost of MLflow tracking: the same run with tracking on and with tracking=none,
alternating in one call so both see the same machine.

    python -m benchmarks.tracking_overhead --rounds 3 --steps 60 [-- extra overrides]

Prints steps/s (median step time after warm-up) for each run and the ratio of the medians.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def run(tracking: str, steps: int, workdir: Path, tag: str, extra: list[str]) -> dict:
    run_dir = workdir / tag
    cmd = [sys.executable, "-m", "src.run", f"tracking={tracking}", f"train.steps={steps}", "train.progress=false", f"hydra.run.dir={run_dir}", *extra]
    if tracking == "mlflow":
        cmd.append(f"tracking.uri=sqlite:///{workdir / 'mlflow.db'}")
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("extra", nargs="*", help="overrides for both runs")
    args = ap.parse_args()
    workdir = Path(tempfile.mkdtemp(prefix="tracking_overhead_"))
    rates: dict[str, list[float]] = {"mlflow": [], "none": []}
    for r in range(args.rounds):
        for tracking in ("mlflow", "none"):
            s = run(tracking, args.steps, workdir, f"{tracking}-{r}", args.extra)
            rates[tracking].append(1.0 / s["step_time_s"])
            print(f"round {r} tracking={tracking:<6} {rates[tracking][-1]:7.2f} steps/s  (loop overhead {100 * s['overhead_frac']:.2f}% of wall time)", flush=True)
    on, off = statistics.median(rates["mlflow"]), statistics.median(rates["none"])
    # Rounds run back to back, so each round's pair saw the same machine load: their ratios
    # spread less than the rates themselves on a noisy machine.
    ratios = sorted(a / b for a, b in zip(rates["mlflow"], rates["none"]))
    print(f"\nmedian steps/s: tracking on {on:.2f}, off {off:.2f}; tracking costs {100 * (1 - on / off):+.1f}%")
    print(f"per-round on/off ratio: median {statistics.median(ratios):.3f}, range {ratios[0]:.3f} to {ratios[-1]:.3f} over {len(ratios)} rounds")


if __name__ == "__main__":
    main()
