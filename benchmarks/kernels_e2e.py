"""The seed's mini_llm training step under each `kernels` setting, run alternately in one call on
the same GPU(s), so the ratios are measured side by side.

    python -m benchmarks.kernels_e2e --settings eager compile triton auto --steps 12 --rounds 1 \\
        --diagnosis tests/fixtures/mini_llm_h200_diagnosis.json

Prints one row per run (under a kernels=auto run, what it chose: auto times its candidates in each
run and may choose differently from one run to the next) and the median per setting: tokens/s per
GPU, MFU, peak memory, median step time, the host's median time to queue a step, and the speedup
over eager; with --rounds above 1, the range of each round's ratio to that round's eager run (a
host-set step swings from round to round, and a median hides it). A host time well under the step
time means the device is the limit; near it, the host is, or the launch queue is full and holds the
host to the device's pace (a profile tells the two apart: `task=profile`'s anatomy splits idle time
into host late and queued). A setting whose kernels save device time can still lose where its Python
path is longer.
Each run is `python -m src.run +exp=fsdp4` (the seed's model, data and optimizer) with
`kernels=SETTING`; `auto` reads --diagnosis (the mini_llm H200 diagnosis kept as a test fixture, or
a fresh one from `+exp=diagnose`). The final loss is printed, but it is no check of a setting's
numerics: the seed's recipe fits random targets at lr 3e-4 with no warm-up or clipping, and eager's
own loss left the plateau on 2 of 6 seeds over 24 steps on an H200 (benchmarks/notes/PERFORMANCE.md section 7,
"kernels=auto's loss spike"); `python -m benchmarks.fp8_loss --variant NAME="kernels=..."` compares
loss curves on a recipe that trains. A setting NAME=OVERRIDES runs those overrides in place of
`kernels=NAME`, e.g. auto's choice as fixed settings, to tell the choice's step time from the
measuring run's:

    python -m benchmarks.kernels_e2e --settings eager auto ce="kernels=compile kernels.fused=[cross_entropy]" \
        --extra data.seq_len=128
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

from benchmarks.fsdp_vs_seed import split_named


def _num(value, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def overrides(setting: str) -> tuple[str, list[str]]:
    """'eager' -> ('eager', ['kernels=eager']); 'ce=kernels=compile kernels.fused=[cross_entropy]'
    -> ('ce', ['kernels=compile', 'kernels.fused=[cross_entropy]'])."""
    name, given = split_named(setting)
    if given is None:
        return setting, [f"kernels={setting}"]
    if not name or not given:
        raise SystemExit(f"--settings {setting!r}: give a kernels setting (eager) or NAME=OVERRIDES (ce=\"kernels=compile kernels.fused=[cross_entropy]\")")
    return name, given


def auto_line(record: dict, optim_impl: str | None) -> str:
    """What kernels=auto chose in one run, from its kernels_auto.json: the fused and compiled ops,
    compiled blocks or not, the optimizer, and the block candidates' GPU (host) ms a step."""
    block = record.get("measured", {}).get("block", {})
    timed = " / ".join(f"{c} {block[c]:.2f} ({_num(block.get(c + '.host'), '.2f')})" for c in ("picked", "compile", "eager") if block.get(c) is not None)
    return (f"fused [{', '.join(record.get('fused') or [])}], compiled [{', '.join(record.get('compiled') or [])}], "
            f"compiled blocks {'yes' if record.get('compile') else 'no'}, optim.impl {optim_impl or 'n/a'}"
            + (f"; block GPU (host) ms a step: {timed}" if timed else "; nothing timed"))


def run(name: str, given: list[str], args: argparse.Namespace, run_dir: Path) -> dict:
    cmd = [
        sys.executable, "-m", "src.run", "+exp=fsdp4", *given, f"dist.nproc={args.nproc}",
        f"train.steps={args.steps}", f"train.untimed_steps={args.warmup}", "train.progress=false", "tracking=none",
        f"hydra.run.dir={run_dir}", *args.extra,
    ]
    if "kernels=auto" in given and not any(o.startswith("kernels.diagnosis=") for o in given):
        cmd.append(f"kernels.diagnosis={Path(args.diagnosis).resolve()}")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{name} ({' '.join(given)}) failed:\n{proc.stderr[-3000:]}")
    return json.loads((run_dir / "summary.json").read_text())


def round_ratios(rows: list[dict], setting: str) -> str:
    """Each round's tokens/s for `setting` over the same round's eager, as a range ("0.94-1.51x"): settings
    run alternately, so a round's pair shares the host's state, and the range shows how far a host-set
    step swings (eager's own rate moved 1.6x between two rounds of one call at 8 x 128 tokens on an H200)."""
    eager = {r["round"]: r["tokens_per_s_per_device"] for r in rows if r["setting"] == "eager"}
    ratios = sorted(r["tokens_per_s_per_device"] / eager[r["round"]] for r in rows if r["setting"] == setting and r["round"] in eager)
    if len(ratios) < 2:
        return "-"
    return f"{ratios[0]:.2f}-{ratios[-1]:.2f}x"


def table(rows: list[dict], settings: list[str]) -> str:
    """The median per setting over its rounds, and the per-round ratios' range."""
    eager = statistics.median([r["tokens_per_s_per_device"] for r in rows if r["setting"] == "eager"] or [float("nan")])
    # SM MHz: rank 0's median clock over the timed steps (src/profiling/gpu_clocks.py): a setting that keeps
    # the GPU busier can run at a lower clock under its power cap
    out = ["| kernels | tok/s/GPU | MFU % | peak GB | step ms | host ms | SM MHz | vs eager | rounds | final loss |",
           "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for setting in settings:
        mine = [r for r in rows if r["setting"] == setting]
        tps = statistics.median(r["tokens_per_s_per_device"] for r in mine)
        mfu = None if mine[0]["mfu"] is None else statistics.median(r["mfu"] for r in mine)
        peak = None if mine[0]["peak_mem_gb"] is None else max(r["peak_mem_gb"] for r in mine)
        hosts = [r["host_step_time_s"] for r in mine if r.get("host_step_time_s") is not None]
        host = 1e3 * statistics.median(hosts) if hosts else None
        clocks = [r["gpu_sm_clock_mhz"] for r in mine if r.get("gpu_sm_clock_mhz") is not None]
        clock = statistics.median(clocks) if clocks else None
        out.append(f"| {setting} | {tps:,.0f} | {_num(mfu, '.1f')} | {_num(peak, '.2f')} | {1e3 * statistics.median(r['step_time_s'] for r in mine):.1f} | "
                   f"{_num(host, '.1f')} | {_num(clock, '.0f')} | {tps / eager:.3f}x | {round_ratios(rows, setting)} | {mine[-1]['final_loss']:.4f} |")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["eager", "compile", "triton", "auto"])
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--diagnosis", default="tests/fixtures/mini_llm_h200_diagnosis.json")
    ap.add_argument("--out", type=Path, default=Path("bench_out/kernels_e2e"))
    ap.add_argument("--extra", nargs="*", default=[], help="more overrides for every run")
    args = ap.parse_args()
    settings = dict(overrides(s) for s in args.settings)  # every setting read before the first run

    rows = []
    for r in range(args.rounds):
        for setting, given in settings.items():
            run_dir = args.out / f"{setting}-r{r}"
            s = run(setting, given, args, run_dir)
            rows.append({"setting": setting, "round": r, **s})
            print(f"kernels={setting:8s} round {r}: {s['tokens_per_s_per_device']:,.0f} tok/s/GPU, MFU {_num(s['mfu'], '.1f')}%, "
                  f"peak {_num(s['peak_mem_gb'], '.2f')} GB, loss {s['final_loss']:.4f}, SM {_num(s.get('gpu_sm_clock_mhz'), '.0f')} MHz", flush=True)
            choice = run_dir / "kernels_auto.json"
            if choice.is_file():  # the run's own choice beside its speed: auto can choose differently from run to run
                print(f"  {setting} chose: {auto_line(json.loads(choice.read_text()), s.get('optim_impl'))}", flush=True)
    print()
    print(table(rows, list(settings)))


if __name__ == "__main__":
    main()
