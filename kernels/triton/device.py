"""What the launchers ask of the device a tensor lives on: its index, SMs, shared memory, and how
many software-pipeline stages a row loop may take. Off CUDA (Triton's interpreter on a CPU) the
answers are small fixed numbers, so CPU tests still walk several rows per program."""
from __future__ import annotations

import functools
import sys

import torch

# Shared memory a kernel's pipeline buffers may take, below the per-block limit: room for the
# reductions' scratch and the compiler's own (an RMSNorm backward asked for a few bytes beyond its
# pipeline buffers).
SMEM_HEADROOM = 16 * 1024


def interpreted() -> bool:
    """Whether Triton's interpreter runs the kernels: TRITON_INTERPRET read by Triton's own knob, as
    `triton.jit` reads it (1, true, on or yes; a check of the variable against "1" alone refused a run
    Triton would have interpreted), read at each call. False where Triton is not installed."""
    try:
        from triton import knobs
    except ImportError:
        return False
    return bool(knobs.runtime.interpret)


def kernels_run_on(t: torch.Tensor) -> bool:
    """Whether the kernels run where `t` lives: CUDA, or a CPU under Triton's interpreter."""
    return t.is_cuda or (t.device.type == "cpu" and interpreted())


# Rows a tile for the row kernels off CUDA, where Triton's interpreter runs them (the CPU tests): there
# each op of each program costs tens of microseconds of Python over numpy whatever the tile's size,
# so a program a row made 3 float8 steps of a tiny model on a CPU take 116 s, 16 rows a tile 7.3 s,
# 64 rows 6.1 s, with the same bits.
INTERPRETER_ROWS = 64


def rows_per_tile(configured: int, on_cuda: bool) -> int:
    """A row kernel's rows a tile: its GPU setting on CUDA, at least INTERPRETER_ROWS elsewhere."""
    return configured if on_cuda else max(configured, INTERPRETER_ROWS)


def device_index(t: torch.Tensor) -> int:
    """t's CUDA device index, or -1 off CUDA."""
    if not t.is_cuda:
        return -1
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


@functools.cache
def _properties(index: int):
    """CUDA device `index`'s properties, read once (a driver query each call otherwise)."""
    return torch.cuda.get_device_properties(index)


# The attribute torch.compiler.assume_constant_result sets, all it does (torch 2.11, 2.13, 2.14.1,
# 2.15.0: tests/unit/test_kernel_device.py compares the two on the torch installed).
MARKED_CONSTANT = "_dynamo_marked_constant"


def constant_for_compile(fn):
    """torch.compiler.assume_constant_result(fn) without the import of torch._dynamo that the
    decorator does first: 1.5 s of every process that imports the kernels, the launcher that never
    compiles among them (a CLI run on a 2-core machine). Where Dynamo is loaded already, its own."""
    if "torch._dynamo" in sys.modules:
        return torch.compiler.assume_constant_result(fn)
    setattr(fn, MARKED_CONSTANT, True)
    return fn


# The answers below are marked constant for torch.compile: Dynamo calls each one when it traces a
# fused norm inside a compiled block and keeps the answer, rather than tracing through the cache
# above (an lru_cache-wrapped function it warns about at each compile).
@constant_for_compile
def sm_count(index: int) -> int:
    """SMs of CUDA device `index`; 2 off CUDA."""
    return _properties(index).multi_processor_count if index >= 0 else 2


@constant_for_compile
def compute_major(index: int) -> int:
    """The major compute capability of CUDA device `index` (9 on Hopper)."""
    return _properties(index).major


@constant_for_compile
def smem_per_block(index: int) -> int:
    """The most shared memory one block may ask for (the opt-in limit: 227 KB on Hopper)."""
    if index < 0:
        return 1 << 30  # the interpreter has no shared memory to run out of
    props = _properties(index)
    return getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block


def pipeline_stages(requested: int, bytes_per_stage: int, index: int) -> int:
    """Stages for a `tl.range(..., num_stages=n)` loop whose loads take `bytes_per_stage` of shared
    memory a stage: Triton's pipeliner keeps n - 1 stages of them buffered, so wide rows get fewer
    stages (down to 1, the loop as written) instead of a kernel that does not fit. An RMSNorm
    backward at 4 stages did not compile from 16384 bf16 columns with the residual (3 x 96 KB)."""
    if requested <= 1:
        return 1
    room = smem_per_block(index) - SMEM_HEADROOM
    return max(1, min(requested, 1 + room // max(1, bytes_per_stage)))
