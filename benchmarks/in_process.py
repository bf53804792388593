"""`python -m src.run OVERRIDES` inside this process, for the benches that watch a run from within
(a patched Trainer method, torch's sync debugging): only one-GPU runs stay in this process
(dist.nproc=1), since a launched worker would carry none of it."""
from __future__ import annotations

import runpy
import sys


def run_src(overrides: list[str]) -> None:
    """The run as the CLI would do it, on one rank (dist.nproc=1 is added where not given: an
    experiment's own count, +exp=fsdp4's 4, would launch workers); its SystemExit(0) returns, any
    other status is raised."""
    if any(o.startswith("dist.nproc=") and o != "dist.nproc=1" for o in overrides):
        raise SystemExit("this bench watches the run in its own process: give dist.nproc=1")
    if "dist.nproc=1" not in overrides:
        overrides = [*overrides, "dist.nproc=1"]
    argv = sys.argv
    sys.argv = ["src.run", *overrides]
    try:
        runpy.run_module("src.run", run_name="__main__")
    except SystemExit as e:
        if e.code not in (0, None):
            raise
    finally:
        sys.argv = argv
