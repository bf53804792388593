"""How long the host takes to queue each phase of a one-GPU run's step, with the device out of the way.

    python -m benchmarks.host_phases --after 6 -- +exp=fsdp4 dist.nproc=1 train.steps=16 [kernels=auto ...]

In a training step the host queues kernels while the device runs earlier ones; where the host's
path is longer than the device's, the device idles, and nothing in the step's own timings says so
(host time to queue a step includes the waits in full launch queues). From step --after on, each
step here is split at forward + loss | backward | optimizer, the device is synchronized before
each phase, and the host time of each phase is read: with the queue empty, no launch waits, so
that is what the host's Python and launch path costs. The device time of each phase is timed by
CUDA events around the same, synchronized phases (a phase whose host path is the longer of the
two shows the host's time there too). A step whose host total approaches the step time of an
unsynchronized run is host-bound.

`--cprofile FILE` also runs cProfile over the same steps and writes its functions by own time
(cProfile slows Python several-fold; its shares, not its times, are what to read), with backward
run on the calling thread so that cProfile sees it. A FILE ending in `.prof` gets the raw
statistics instead, for `python -m pstats FILE` (callers and callees) or snakeviz.

The run is `python -m src.run OVERRIDES` in this process (dist.nproc=1). Synchronizing every phase
makes the measured steps slower than training's; their losses are unchanged.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import sys
import time

PHASES = ("forward", "backward", "optimizer", "rest")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=int, default=6, help="time steps from this one on (the first compile, measure, warm up)")
    ap.add_argument("--cprofile", default=None, help="also profile the timed steps with cProfile; own-time table to this file")
    ap.add_argument("overrides", nargs="*", help="overrides for src.run (after --)")
    args = ap.parse_args()

    import torch

    import src.train.trainer as trainer_module
    from benchmarks.in_process import run_src
    from src.train.trainer import Trainer

    if not torch.cuda.is_available():
        raise SystemExit("host_phases needs a CUDA GPU: on a CPU the host runs the kernels itself")

    host: dict[str, list[float]] = {p: [] for p in PHASES}
    device: dict[str, list[float]] = {p: [] for p in PHASES[:3]}
    state = {"on": False, "t": 0.0, "ev": None}
    profiler = cProfile.Profile() if args.cprofile else None

    def begin(phase: str) -> None:
        if phase == "forward" and state.get("optimizer_end") is not None:
            # the loop's own work between steps: the last step's figures, the next batch, logging
            host["rest"].append(1e3 * (time.perf_counter() - state["optimizer_end"]))
        torch.cuda.synchronize()
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        state["phase"], state["ev"] = phase, ev
        state["t"] = time.perf_counter()

    def end() -> None:
        host[state["phase"]].append(1e3 * (time.perf_counter() - state["t"]))
        ev = torch.cuda.Event(enable_timing=True)
        ev.record()
        torch.cuda.synchronize()
        device[state["phase"]].append(state["ev"].elapsed_time(ev))
        state["optimizer_end"] = time.perf_counter() if state["phase"] == "optimizer" else None

    run_step, train_step = Trainer.run_step, Trainer.train_step
    step_of_optimizer = trainer_module.optimizer_step
    tensor_backward = torch.Tensor.backward

    def timed_run_step(self, step, *a, **kw):
        state["on"] = step >= args.after
        if not state["on"]:
            return run_step(self, step, *a, **kw)
        if profiler:
            profiler.enable()
        try:
            return run_step(self, step, *a, **kw)
        finally:
            if profiler:
                profiler.disable()

    def timed_train_step(self, *a, **kw):
        if state["on"]:
            begin("forward")
        return train_step(self, *a, **kw)

    def timed_backward(self, *a, **kw):
        if not state["on"]:
            return tensor_backward(self, *a, **kw)
        end()
        begin("backward")
        out = tensor_backward(self, *a, **kw)
        end()
        return out

    def timed_optimizer_step(*a, **kw):
        if not state["on"]:
            return step_of_optimizer(*a, **kw)
        begin("optimizer")
        out = step_of_optimizer(*a, **kw)
        end()
        return out

    Trainer.run_step, Trainer.train_step = timed_run_step, timed_train_step
    trainer_module.optimizer_step, torch.Tensor.backward = timed_optimizer_step, timed_backward
    try:
        # cProfile sees one thread: under it, autograd runs backward on the calling thread, not its
        # device thread, so backward's Python (autograd Functions, FSDP2's hooks) is counted
        with torch.autograd.set_multithreading_enabled(not profiler):
            run_src(args.overrides)
    finally:
        Trainer.run_step, Trainer.train_step = run_step, train_step
        trainer_module.optimizer_step, torch.Tensor.backward = step_of_optimizer, tensor_backward
    n = len(host["optimizer"])
    if not n:
        raise SystemExit(f"no step from {args.after} on ran in this process: give dist.nproc=1 and train.steps above --after")
    print(f"\nhost and device ms per phase, medians over {n} steps (each phase synchronized before it starts)")
    print("| phase | host ms | device ms |\n|---|---:|---:|")
    for p in PHASES:
        dev = f"{statistics.median(device[p]):.2f}" if p in device else "-"
        print(f"| {p} | {statistics.median(host[p]) if host[p] else float('nan'):.2f} | {dev} |")
    total_host = sum(statistics.median(host[p]) for p in PHASES if host[p])
    total_dev = sum(statistics.median(device[p]) for p in device)
    print(f"| step | {total_host:.2f} | {total_dev:.2f} |")
    if profiler and args.cprofile.endswith(".prof"):
        profiler.dump_stats(args.cprofile)
        print(f"cProfile of the timed steps (raw statistics): {args.cprofile}")
    elif profiler:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(60)
        with open(args.cprofile, "w") as f:
            f.write(out.getvalue())
        print(f"cProfile of the timed steps by own time: {args.cprofile}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
