"""What the launchers ask of the device a tensor lives on: its index, SMs, shared memory, and how
many software-pipeline stages a row loop may take. Off CUDA (Triton's interpreter on a CPU) the
answers are small fixed numbers, so CPU tests still walk several rows per program."""
from __future__ import annotations

import torch

# Shared memory a kernel's pipeline buffers may take, below the per-block limit: room for the
# reductions' scratch and the compiler's own (an RMSNorm backward at 3 buffers of 96 KB asked for
# 76 bytes beyond them on an H200).
SMEM_HEADROOM = 16 * 1024


def device_index(t: torch.Tensor) -> int:
    """t's CUDA device index, or -1 off CUDA."""
    if not t.is_cuda:
        return -1
    return t.device.index if t.device.index is not None else torch.cuda.current_device()


# Device properties, read once per device. Memoised in plain dicts, not functools.cache, and marked
# constant for torch.compile: Dynamo then takes each answer as a constant when it traces a fused
# norm inside a compiled block, where an lru_cache-wrapped function is traced through with a
# warning to the user at each compile.
_SM_COUNT: dict[int, int] = {}
_SMEM_PER_BLOCK: dict[int, int] = {}
_COMPUTE_MAJOR: dict[int, int] = {}


@torch.compiler.assume_constant_result
def sm_count(index: int) -> int:
    """SMs of CUDA device `index`; 2 off CUDA."""
    count = _SM_COUNT.get(index)
    if count is None:
        count = _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count if index >= 0 else 2
    return count


@torch.compiler.assume_constant_result
def compute_major(index: int) -> int:
    """The major compute capability of CUDA device `index` (9 on an H100/H200)."""
    major = _COMPUTE_MAJOR.get(index)
    if major is None:
        major = _COMPUTE_MAJOR[index] = torch.cuda.get_device_capability(index)[0]
    return major


@torch.compiler.assume_constant_result
def smem_per_block(index: int) -> int:
    """The most shared memory one block may ask for (the opt-in limit: 227 KB on an H100/H200)."""
    limit = _SMEM_PER_BLOCK.get(index)
    if limit is None:
        if index < 0:
            limit = 1 << 30  # the interpreter has no shared memory to run out of
        else:
            props = torch.cuda.get_device_properties(index)
            limit = getattr(props, "shared_memory_per_block_optin", 0) or props.shared_memory_per_block
        _SMEM_PER_BLOCK[index] = limit
    return limit


def pipeline_stages(requested: int, bytes_per_stage: int, index: int) -> int:
    """Stages for a `tl.range(..., num_stages=n)` loop whose loads take `bytes_per_stage` of shared
    memory a stage: Triton's pipeliner keeps n - 1 stages of them buffered, so wide rows get fewer
    stages (down to 1, the loop as written) instead of a kernel that does not fit. An RMSNorm
    backward at 4 stages did not compile from 16384 bf16 columns with the residual (3 x 96 KB)."""
    if requested <= 1:
        return 1
    room = smem_per_block(index) - SMEM_HEADROOM
    return max(1, min(requested, 1 + room // max(1, bytes_per_stage)))
