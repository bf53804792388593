"""Inductor settings a run needs, scoped to the run and put back after it.

- speed.cudagraphs: `triton.cudagraphs` (torch.compile's reduce-overhead mode, one of the options
  torch.compile documents) for every graph the run compiles. Set for the run, not passed to
  torch.compile(options=...): each block's backward graph is compiled lazily at the first backward,
  after a per-compile option has been restored.
- precision=fp8 through torchao with rowwise scales: `emulate_precision_casts`, torchtitan's
  short-term fix for the same recipes of pytorch/pytorch#150859 (Inductor's low-precision casts
  rounding unlike eager's); it goes when that issue is closed.

Both go through `torch._inductor.config.patch`, which restores the previous values on the way out,
so an in-process sweep's next job starts with torch's defaults. The graph counts below read
Inductor's cudagraph trees, a private structure: where it is not as expected they are None.
"""
from __future__ import annotations

import contextlib
import logging

import torch
from omegaconf import DictConfig

log = logging.getLogger("src.train")


def run_settings(cfg: DictConfig) -> dict[str, object]:
    """The Inductor config a run of `cfg` sets: {name: value}; empty for one that needs none."""
    settings: dict[str, object] = {}
    if cfg.speed.cudagraphs:
        settings["triton.cudagraphs"] = True
    precision = cfg.precision
    if precision.float8 and str(precision.fp8_impl) == "torchao" and str(precision.fp8_recipe) != "tensorwise":
        settings["emulate_precision_casts"] = True
    return settings


@contextlib.contextmanager
def inductor_config(cfg: DictConfig):
    """`run_settings(cfg)` for the duration of a run (or of kernels=auto's measurement of its candidates)."""
    settings = run_settings(cfg)
    if not settings:
        yield
        return
    import torch._inductor.config as inductor

    if cfg.speed.cudagraphs:
        # code compiled earlier in this process (a sweep's job without graphs) would be reused as it is
        release_cuda_graphs()
    with inductor.patch(settings):
        yield


def cudagraph_skips() -> int | None:
    """Compiled graphs Inductor ran without a CUDA graph so far in this process (a mutated input, a
    CPU tensor, too many re-recordings; each reason is logged as it happens); None where this torch
    keeps no such counter."""
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return None
    return counters["inductor"]["cudagraph_skips"]


def cudagraph_counts(device: torch.device) -> dict[str, int | None]:
    """The CUDA graphs the trees hold on `device` (`graphs`: one a compiled block's forward or
    backward at each place in the step) and how often one was recorded again because an input it
    reads in place (a weight) had moved (`rerecords`); None for both where this torch's trees are
    not as read here."""
    try:
        from torch._inductor.cudagraph_trees import get_manager

        manager = get_manager(device.index if device.index is not None else torch.cuda.current_device(), create_if_none_exists=False)
        if manager is None or manager.roots is None:
            return {"graphs": 0, "rerecords": 0}
        graphs, nodes = 0, [node for roots in manager.roots.values() for node in roots]
        while nodes:
            node = nodes.pop()
            graphs += 1
            nodes.extend(child for children in node.children.values() for child in children)
        return {"graphs": graphs, "rerecords": sum(n for per_node in manager.num_rerecord.values() for n in per_node.values())}
    except (ImportError, AttributeError, TypeError) as err:
        log.warning("speed.cudagraphs: this torch's cudagraph trees are not as read here (%s); the graph counts are left out", err)
        return {"graphs": None, "rerecords": None}


def release_cuda_graphs() -> None:
    """Free the run's CUDA graphs and their memory pool, and Dynamo's compiled code with them: a
    compiled block keeps the trees it was first run under, so the next run in this process (an
    in-process sweep's job) compiles afresh, under its own settings, instead of calling graphs that
    are gone. Run before the process group goes (torchtitan releases its graphs there)."""
    import torch._dynamo

    torch._dynamo.reset()  # the trees too (reset_cudagraph_trees)
