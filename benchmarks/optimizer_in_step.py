"""AdamW's update timed where the run does it, again right after, and alone once the run is over.

    python -m benchmarks.optimizer_in_step --after 4 -- +exp=fsdp4 dist.nproc=1 train.steps=14

In the seed's step on one H200 the profiler gives AdamW's kernels 8.0 ms a step, while the same
update over the same parameter shapes, timed alone, takes 5.9 ms. This tells the two apart inside
one run: from step --after on, each `optimizer.step()` is bracketed by CUDA events (in step: right
behind backward), then run a second time over the same gradients (again: right behind the first,
host already ahead), and after the last step, a few more times with the device idle before each
(alone). The second and later updates change the weights further; the run's losses after --after
are not the experiment's. Times are GPU time between events; the bytes are those of one fused
update (read parameter, gradient and both moments; write parameter and moments, and the bf16
copies TritonAdamW writes under speed.cast_in_step), in the moments' own dtype. Under
optim.impl=triton a step that reports its norm sums the gradients' squares inside the update: the
in-step and again rows both carry them (the flag is set around the step's update), the alone rows
do not.
"""
from __future__ import annotations

import argparse
import statistics
import sys


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=int, default=4, help="time optimizer steps from this one on")
    ap.add_argument("--alone", type=int, default=5, help="updates timed alone after the run")
    ap.add_argument("overrides", nargs="*", help="overrides for src.run (after --)")
    args = ap.parse_args()

    import torch

    from benchmarks.in_process import run_src

    if not torch.cuda.is_available():
        raise SystemExit("optimizer_in_step needs a CUDA GPU")
    from perflab_kernels.triton.adamw import TritonAdamW, local_shard

    classes = (torch.optim.AdamW, TritonAdamW)  # optim.impl=triton's step is its own
    steps = {cls: cls.step for cls in classes}  # AdamW's may be Adam's, inherited
    own = {cls: "step" in cls.__dict__ for cls in classes}
    seen: dict = {"calls": 0, "optimizer": None}
    in_step, again = [], []

    def timed(step):
        def run(self, *a, **kw):
            seen["calls"] += 1
            seen["optimizer"] = self
            if seen["calls"] <= args.after:
                return step(self, *a, **kw)
            events = [torch.cuda.Event(enable_timing=True) for _ in range(3)]
            events[0].record()
            out = step(self, *a, **kw)
            events[1].record()
            step(self, *a, **kw)
            events[2].record()
            in_step.append(events[:2])
            again.append(events[1:])
            return out

        return run

    for cls in classes:
        cls.step = timed(steps[cls])
    try:
        run_src(args.overrides)
    finally:
        for cls in classes:
            if own[cls]:
                cls.step = steps[cls]
            else:
                del cls.step
    opt = seen["optimizer"]
    step = steps[type(opt)] if opt is not None else None
    if opt is None or not in_step:
        raise SystemExit(f"no AdamW step after the first {args.after} ran in this process: give dist.nproc=1 and more train.steps")
    alone = []
    for _ in range(args.alone):
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        step(opt)
        end.record()
        alone.append((start, end))
    torch.cuda.synchronize()
    params = [p for g in opt.param_groups for p in g["params"] if p.grad is not None]
    local, grads = [local_shard(p) for p in params], [local_shard(p.grad) for p in params]
    # read and write the parameter and both moments (fp32, or bf16 under optim.state_dtype), read the
    # gradient; TritonAdamW's bf16 copies of the parameters (speed.cast_in_step) written too
    moments = [local_shard(opt.state[p]["exp_avg"]) for p in params]
    moved = sum(t.numel() * (2 * t.element_size() + g.element_size() + 4 * m.element_size()) for t, g, m in zip(local, grads, moments))
    moved += sum(c.out.numel() * c.out.element_size() for _, c in getattr(opt, "_copies", {}).values() if c.out.untyped_storage().size())
    print(f"\nAdamW over {len(params)} parameters, {sum(t.numel() for t in local) / 1e6:.0f}M elements, {moved / 1e9:.2f} GB moved an update")
    print("| where | updates | median ms | min ms | TB/s at the median |\n|---|---:|---:|---:|---:|")
    for name, pairs in (("in step, behind backward", in_step), ("again, right after", again), ("alone, device idle before", alone)):
        ms = [a.elapsed_time(b) for a, b in pairs]
        med = statistics.median(ms)
        print(f"| {name} | {len(ms)} | {med:.2f} | {min(ms):.2f} | {moved / (med * 1e-3) / 1e12:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
