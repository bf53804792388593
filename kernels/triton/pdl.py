"""Programmatic dependent launch (PDL) for the row kernels, on Hopper and newer.

A graph-replayed norm's forward + backward runs three short kernels; each pays a few microseconds
of launch and ramp before its first load is in flight (the marginal bytes stream at the copy
ceiling, the fixed cost per kernel does not). With PDL a kernel
is launched while the one before it in the stream is still running: its programs are placed, wait
in `gdc_wait()` for the previous kernel's writes to land, and start loading at once.

Each kernel that takes part, when `use_gdc` is true: calls `gdc_wait()` before its first load of
anything another kernel may have written, then `gdc_launch_dependents()` so that the next kernel
may be placed as this one's programs retire. The launch passes `launch_pdl=True`. Correctness
rests on the waits alone: a kernel launched early still waits for the whole previous grid and its
memory, so a neighbour that knows nothing of PDL (a cuBLAS GEMM) is ordered as without it.

Between ops it is off (`ENABLED = False`): benchmarks/kernel_configs.py's pdl group, alternating off
and on, found RMSNorm's forward + backward about a sixth slower with it (likely the backward's
persistent programs, placed early as the forward's retire, landing unevenly over the SMs) and the
others level. Inside one op, a launch that always follows another (RMSNorm's dw after its backward) can be a
dependent on its own: `available` says whether the device can. Triton's interpreter has no
griddepcontrol, so under TRITON_INTERPRET=1 neither is used.

Kernels call `gdc_prologue` by its own name (`from perflab_kernels.triton.pdl import gdc_prologue`), never
as `pdl.gdc_prologue`: under torch.compile Inductor copies a user kernel's source into a module of
its own and imports the JIT functions it calls by name, so a module it hangs off is undefined there
(a compiled block with the fused norms failed with NameError 'pdl').
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from perflab_kernels.triton.device import compute_major, constant_for_compile, device_index, interpreted

ENABLED = False


def available(t: torch.Tensor) -> bool:
    """Whether t's device can launch with PDL: a CUDA tensor on compute capability >= 9, not Triton's
    interpreter (which has no griddepcontrol, whatever the tensor's device), and not inside a
    torch.compile trace (Inductor launches a user kernel itself, with no `launch_pdl`: a compiled
    block with the norms' dw as a dependent failed to trace into one graph)."""
    return t.is_cuda and not torch.compiler.is_compiling() and _available_on(device_index(t))


@constant_for_compile  # a constant to Dynamo, as device.py's answers are
def _available_on(index: int) -> bool:
    return not interpreted() and compute_major(index) >= 9


def use_gdc(t: torch.Tensor) -> bool:
    """Whether kernels on t's device launch with PDL: ENABLED and available(t)."""
    return ENABLED and available(t)


@triton.jit
def gdc_prologue(USE_GDC: tl.constexpr):
    """A PDL kernel's first lines: wait for the previous kernel's writes, then let the next kernel
    be placed as this one's programs retire. Nothing when USE_GDC is false."""
    if USE_GDC:
        tl.extra.cuda.gdc_wait()
        tl.extra.cuda.gdc_launch_dependents()


def launch_options(gdc: bool) -> dict:
    """The launch keyword for a kernel whose USE_GDC constexpr is `gdc`."""
    return {"launch_pdl": True} if gdc else {}
