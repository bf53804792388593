"""Launching a @triton.jit kernel with less host work per call.

`kernel[grid](...)` goes through JITFunction.run on every call: it binds the arguments to the
signature, computes the specialisation key, hashes it into the kernel cache, re-reads Triton's
knobs and checks the kernel's globals before it reaches the driver. For a row kernel of 20-40 us
that host path is a large share of the call (an RMSNorm forward+backward through autograd measured
234 us of CPU for about 75 us of H200 work, docs/PERFORMANCE.md section 5), and the GPU waits.

`FastKernel` keeps the CompiledKernel Triton returned for each specialisation the kernel was
launched with, keyed by what Triton specialises on (tensor dtypes and 16-byte alignment, integers
equal to 1 or divisible by 16, constexpr values), and launches it straight through its driver
entry point. The first call with a new key, Triton's interpreter (TRITON_INTERPRET=1, which
compiles nothing), a Triton whose launcher takes other arguments, a launch hook (a profiler such
as proton) and `PERFLAB_TRITON_FAST_LAUNCH=0` all take Triton's ordinary path instead.

Arguments are passed positionally in the kernel's signature order, constexprs included (their
position is their name), and launch options (num_warps, num_stages) as keywords.
"""
from __future__ import annotations

import os

import torch
import triton

_ENABLED = os.environ.get("PERFLAB_TRITON_FAST_LAUNCH", "1") != "0" and os.environ.get("TRITON_INTERPRET") != "1"


def _spec(arg) -> object:
    """What Triton specialises this argument on (runtime/jit.py specialize_impl)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool) or arg is None:
        return arg
    if isinstance(arg, int):
        # i32 vs i64 by range; 1 becomes a constant; divisibility by 16 lets loads vectorise
        return arg == 1, arg % 16 == 0, -(2**31) <= arg < 2**31
    if isinstance(arg, float):
        return float
    return arg  # constexpr values (block sizes, flags) are part of the key as they are


def _launch_hooks_set() -> bool:
    knobs = getattr(triton, "knobs", None)
    runtime = getattr(knobs, "runtime", None)
    return runtime is not None and (runtime.launch_enter_hook is not None or runtime.launch_exit_hook is not None)


class FastKernel:
    """A @triton.jit function with cached compiled launchers (see the module docstring)."""

    def __init__(self, fn):
        self.fn = fn
        self._compiled: dict[tuple, object] = {}
        self._fast = _ENABLED

    def __call__(self, grid: tuple[int, ...], *args, **options):
        g0, g1, g2 = (tuple(grid) + (1, 1))[:3]
        if self._fast:
            key = (tuple(_spec(a) for a in args), tuple(sorted(options.items())), torch.cuda.current_device())
            compiled = self._compiled.get(key)
            if compiled is not None:
                stream = torch.cuda.current_stream().cuda_stream
                try:
                    compiled.run(g0, g1, g2, stream, compiled.function, compiled.packed_metadata, None, None, None, *args)
                    return
                except TypeError:
                    # A launcher that takes other arguments (Triton before 3.3 dropped constexprs)
                    # refuses them while parsing, before anything runs: use Triton's own path.
                    self._fast = False
            else:
                compiled = self.fn[(g0, g1, g2)](*args, **options)
                if hasattr(compiled, "packed_metadata") and not _launch_hooks_set():
                    self._compiled[key] = compiled
                return
        self.fn[(g0, g1, g2)](*args, **options)
