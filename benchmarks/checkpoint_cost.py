"""What a checkpoint costs a training run: the same run without checkpoints, with synchronous and
with asynchronous DCP saves, then a resume from the last one, in one call.

    python -m benchmarks.checkpoint_cost [overrides...]     e.g. +exp=fsdp4 dist.nproc=2

Per mode: save size, time the loop is blocked per save, time until the save is complete, the
run's wall time against the run without checkpoints, and the load time of the resume.
"""
from __future__ import annotations

import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

STEPS, INTERVAL = 12, 4


def run(workdir: Path, name: str, overrides: list[str]) -> dict:
    run_dir = workdir / name
    cmd = [sys.executable, "-m", "src.run", *overrides, f"hydra.run.dir={run_dir}", "tracking=none", "train.progress=false", "train.seed_line=false"]
    subprocess.run(cmd, check=True, capture_output=True, text=True)
    return json.loads((run_dir / "summary.json").read_text())


def main() -> None:
    extra = sys.argv[1:]
    workdir = Path(tempfile.mkdtemp(prefix="ckpt_cost_"))
    base = [*extra, f"train.steps={STEPS}", f"checkpoint.interval={INTERVAL}"]
    rows = {
        "none": run(workdir, "none", [*base, "checkpoint.enabled=false"]),
        "sync": run(workdir, "sync", [*base, "checkpoint.enabled=true"]),
        "async": run(workdir, "async", [*base, "checkpoint.enabled=true", "checkpoint.async_mode=true"]),
    }
    last = workdir / "sync" / "checkpoints" / f"step_{STEPS:08d}"
    resume = run(workdir, "resume", [*extra, f"train.steps={STEPS + 1}", f"checkpoint.resume={last}"])
    print(f"{'mode':<6} {'saves':>5} {'size MB':>8} {'blocked s/save':>15} {'complete s/save':>16} {'wall s':>8} {'vs none':>8}")
    for mode, s in rows.items():
        saves = s["checkpoints"]
        blocked = statistics.median(x["blocking_s"] for x in saves) if saves else 0.0
        total = statistics.median(x["total_s"] for x in saves) if saves else 0.0
        size = saves[-1]["size_mb"] if saves else 0.0
        print(f"{mode:<6} {len(saves):>5} {size:>8.0f} {blocked:>15.2f} {total:>16.2f} {s['wall_s']:>8.2f} {s['wall_s'] - rows['none']['wall_s']:>+8.2f}")
    print(f"resume from {last.name}: load {resume['checkpoint_load_s']:.2f} s, then step {resume['start_step']} at {resume['step_time_s'] * 1e3:.0f} ms")
    print(json.dumps({m: s["checkpoints"] for m, s in rows.items()}))


if __name__ == "__main__":
    main()
