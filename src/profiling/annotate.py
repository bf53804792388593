"""Named ranges around what a training step runs, so every kernel maps back to its module and op.

`module_ranges` pushes `fwd/<module path>` around the forward of each block's children (attn,
ffn, norms) and of the embedding and head, as NVTX ranges (read by ncu and nsys) or
torch.profiler record_function ranges. `step_ranges` marks loss, backward and optimizer.
"""
from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.nn as nn


def _nvtx_push(name: str) -> None:
    torch.cuda.nvtx.range_push(name)


def _nvtx_pop() -> None:
    torch.cuda.nvtx.range_pop()


def module_ranges(model: nn.Module, depth: int = 3) -> list:
    """Register NVTX push/pop hooks on modules up to `depth` dots deep (`layers.3.ffn` is depth 3,
    `layers.3.ffn.up` is too fine: one op). Returns the hook handles."""
    handles = []
    for name, module in model.named_modules():
        if not name or name.count(".") + 1 > depth or name.count(".") + 1 == 2 and name.startswith("layers."):
            continue  # the root, too-deep modules, and `layers.N` itself (its children carry the ranges)
        label = f"fwd/{name}"
        handles.append(module.register_forward_pre_hook(lambda m, a, label=label: _nvtx_push(label)))
        handles.append(module.register_forward_hook(lambda m, a, o: _nvtx_pop()))
    return handles


def nvtx_range(name: str) -> contextlib.AbstractContextManager:
    return torch.cuda.nvtx.range(name)


@contextlib.contextmanager
def profiled_step():
    """The one step ncu profiles (`ncu --profile-from-start off`): cudaProfilerStart/Stop around it,
    with every kernel of the step finished before the stop, inside an NVTX range of its own."""
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    try:
        with nvtx_range("profiled_step"):
            yield
        torch.cuda.synchronize()
    finally:
        torch.cuda.profiler.stop()


def step_marker(enabled: bool) -> Callable[[str], contextlib.AbstractContextManager]:
    """mark("loss") -> an NVTX range when enabled, else a no-op."""
    return nvtx_range if enabled else (lambda name: contextlib.nullcontext())
