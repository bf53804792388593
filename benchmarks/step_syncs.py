"""Which host-device syncs a one-GPU run's steady steps make, and from where.

    python -m benchmarks.step_syncs --after 3 -- +exp=fsdp4 dist.nproc=1 train.steps=8

A step that syncs makes the host wait for the device, then the device wait while the host queues
the next step's first kernels; worse, the host can then never run more than that one step ahead,
so every stretch where its Python path is slower than the kernels it launches leaves the GPU idle.
The training loop reads a logged step's figures through an event after the next step is queued,
which torch's sync debugging does not count; anything it does count in a steady step is a sync
nobody meant. From step --after on until the loop ends, torch.cuda.set_sync_debug_mode("warn")
reports each one, and this prints them grouped by the innermost frames of the project (src/,
kernels/) that led to it.

The run is `python -m src.run OVERRIDES` in this process (dist.nproc=1: a launched worker would not
carry the mode). Exit status 1 when a steady step synced.
"""
from __future__ import annotations

import argparse
import collections
import sys
import traceback
import warnings
from pathlib import Path

_ROOT = Path(__file__).resolve().parents[2]
_SYNC = "synchronizing CUDA operation"


def _where(stack: list[traceback.FrameSummary], depth: int) -> str:
    """The innermost `depth` project frames (this file's and the runpy shim's left out)."""
    mine = [f for f in stack if f.filename.startswith(str(_ROOT)) and not f.filename.endswith("step_syncs.py")]
    return " <- ".join(f"{Path(f.filename).relative_to(_ROOT)}:{f.lineno} {f.name}" for f in reversed(mine[-depth:])) or "(outside the project)"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--after", type=int, default=3, help="count syncs from this step on (the first steps compile, measure, warm up)")
    ap.add_argument("--depth", type=int, default=3, help="project frames shown per sync site")
    ap.add_argument("overrides", nargs="*", help="overrides for src.run (after --)")
    args = ap.parse_args()

    import torch

    import src.train.trainer as trainer_module
    from benchmarks.in_process import run_src
    from src.train.trainer import Trainer

    if not torch.cuda.is_available():
        raise SystemExit("step_syncs needs a CUDA GPU: torch's sync debugging counts CUDA syncs only")
    sites: collections.Counter[str] = collections.Counter()
    counting = {"on": False, "steps": 0}
    run_step = Trainer.run_step

    def counted_run_step(self, step, *a, **kw):
        counting["steps"] += 1
        if step >= args.after and not counting["on"]:
            torch.cuda.set_sync_debug_mode("warn")
            counting["on"] = True
        return run_step(self, step, *a, **kw)

    loop = trainer_module.train_loop

    def counted_loop(*a, **kw):  # the count ends with the loop: what comes after (summary, MLflow) may sync
        try:
            return loop(*a, **kw)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    shown = warnings.showwarning

    def on_warning(message, category, filename, lineno, file=None, line=None):
        if _SYNC in str(message):
            sites[_where(traceback.extract_stack()[:-1], args.depth)] += 1
        else:
            shown(message, category, filename, lineno, file, line)

    Trainer.run_step, trainer_module.train_loop = counted_run_step, counted_loop
    try:
        with warnings.catch_warnings():  # the filters and showwarning as they were, after
            warnings.showwarning = on_warning
            warnings.simplefilter("always")  # each sync, not the first per site
            run_src(args.overrides)
    finally:
        torch.cuda.set_sync_debug_mode("default")
        Trainer.run_step, trainer_module.train_loop = run_step, loop
    if not counting["on"]:
        raise SystemExit(f"no step from {args.after} on ran in this process ({counting['steps']} steps here): "
                         "give dist.nproc=1 and train.steps above --after")
    total = sum(sites.values())
    print(f"\nsyncs from step {args.after} on: {total}")
    if total:
        print("| count | where (innermost project frames first) |\n|---:|---|")
        for where, n in sites.most_common():
            print(f"| {n} | {where} |")
    return 1 if total else 0


if __name__ == "__main__":
    sys.exit(main())
