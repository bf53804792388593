"""A cheaper host path for launching a Triton kernel whose launches repeat with the same arguments.

`kernel[grid](*args, **meta)` costs over twice the host time of calling the compiled kernel's
launcher directly (benchmarks/kernel_configs.py --only launch times both):
JITFunction.run binds the arguments, works out each one's specialisation (dtype, 16-byte alignment,
integers equal to 1 or divisible by 16) and hashes them into its cache key before the C launcher
runs. A training step launches the same kernel with the same shapes over and over, so `Launcher`
keys its own cache on what decides the specialisation, as cheaply as Python allows: each
tensor's dtype and alignment, each integer's specialisation, each constexpr and launch option, and
Triton's compile knobs. A hit calls the compiled kernel's launcher directly, as JITFunction.run
itself ends; a miss (the first launch of a shape) goes through `kernel[grid]` and keeps the kernel
it returns.

The plain path is kept wherever the cached one would be wrong or blind: under torch.compile (Dynamo
traces `kernel[grid]`, not this), under Triton's interpreter (no compiled kernel comes back), and
while a launch hook is set (profilers such as Proton read each launch's metadata).
"""
from __future__ import annotations

import torch

from triton import knobs

# False sends every launch through `kernel[grid]` (benchmarks/kernel_configs.py's launch group
# alternates the two to measure what the cache saves).
ENABLED = True

# Distinct keys kept per kernel before the cache starts over: a run has a handful (one per dtype,
# width and alignment); integers are keyed by their specialisation, not their value, so varying
# token counts add at most a few.
MAX_KEYS = 256


def arg_key(arg: object) -> object:
    """What of a kernel argument decides how Triton specialises it: a tensor's dtype and whether its
    address is 16-byte aligned; an integer's type (bool and int differ: u1 against i32), whether it
    is 1, whether it divides by 16 and whether it needs 32 or 64 bits; a float's type alone (Triton
    does not specialise floats); anything else by type and value. Integers keyed by what Triton
    looks at, not by value, so a run whose token count changes still hits."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if isinstance(arg, bool):
        return bool, arg
    if isinstance(arg, int):
        return int, arg == 1, arg % 16 == 0, 0 if -(1 << 31) <= arg < 1 << 31 else 1 if -(1 << 63) <= arg < 1 << 63 else 2
    if isinstance(arg, float):
        return float
    return type(arg), arg


def meta_key(meta: dict) -> tuple:
    """The constexprs' and launch options' share of a launch's key (types too: True and 1 compile apart)."""
    return tuple((name, type(value), value) for name, value in meta.items())


def _compile_knobs() -> tuple:
    """Triton's settings that JITFunction.run adds to its own cache key (read per launch, a small
    cost each): turning one on mid-process must not be answered with a kernel compiled without it."""
    compilation = knobs.compilation
    return (knobs.runtime.debug, getattr(compilation, "instrumentation_mode", None), getattr(compilation, "fpsan_homomorphic_casts", None))


def _hooked() -> bool:
    """Whether a launch hook (enter or exit) is set. Triton 3.5+ keeps an empty HookChain there when
    none is (and then builds each launch's metadata anyway: part of what `kernel[grid]` costs);
    older versions keep None."""
    runtime = knobs.runtime
    return any(bool(getattr(hook, "calls", hook)) for hook in (runtime.launch_enter_hook, runtime.launch_exit_hook))


def _raw_stream() -> int:
    # What Triton's driver asks torch for (driver.active.get_current_stream): the raw stream handle
    # of the current device, without building a torch.cuda.Stream object (a few microseconds).
    return torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())


def _stream_object() -> int:
    return torch.cuda.current_stream().cuda_stream


# torch's private accessors where this torch has them (2.11-2.15 do), else the public ones
_current_stream = _raw_stream if hasattr(torch._C, "_cuda_getCurrentRawStream") else _stream_object
_current_device = getattr(torch._C, "_cuda_getDevice", torch.cuda.current_device)


class Launcher:
    """`Launcher(kernel)(grid, *args, **meta)` launches as `kernel[grid](*args, **meta)` does.

    `meta` holds the constexprs and the launch options (num_warps, num_stages, launch_pdl); every
    constexpr must be passed by keyword after the positional arguments, so that the launch can hand
    the C launcher the full argument list in the kernel's own order."""

    def __init__(self, kernel):
        self.kernel = kernel
        self.compiled: dict[tuple, tuple] = {}
        self.hits = 0
        self.misses = 0

    def __call__(self, grid: tuple[int, ...], *args, **meta) -> None:
        self.launch(grid, args, meta, meta_key(meta))

    def launch(self, grid: tuple[int, ...], args: tuple, meta: dict, meta_part: tuple) -> None:
        """The launch with `meta`'s share of the key already built (`meta_key(meta)`): a caller that
        launches with the same constexprs and options over and over keeps it, which saves a good
        part of what the key costs (building the constexprs' tuples)."""
        if not ENABLED or torch.compiler.is_compiling() or _hooked():
            self.kernel[grid](*args, **meta)
            return
        key = (_current_device() if torch.cuda.is_initialized() else -1, tuple(map(arg_key, args)), meta_part, _compile_knobs())
        entry = self.compiled.get(key)
        if entry is None:
            self._launch_and_keep(key, grid, args, meta)
            return
        compiled, tail = entry
        self.hits += 1
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, _current_stream(), compiled.function,
                     compiled.packed_metadata, None, None, None, *args, *tail)

    def _launch_and_keep(self, key: tuple, grid: tuple[int, ...], args: tuple, meta: dict) -> None:
        self.misses += 1
        compiled = self.kernel[grid](*args, **meta)
        compiled = compiled.result() if hasattr(compiled, "result") else compiled  # an async compile's future
        names = getattr(self.kernel, "arg_names", None)
        if compiled is None or not hasattr(compiled, "packed_metadata") or names is None:
            return  # the interpreter: nothing compiled to keep
        constexprs = names[len(args):]
        params = getattr(self.kernel, "params", ())
        if any(name not in meta for name in constexprs) or not all(getattr(p, "is_constexpr", False) for p in params[len(args):]):
            return  # a parameter left to its default, or a runtime argument passed by keyword: launched the plain way
        if len(self.compiled) >= MAX_KEYS:
            self.compiled.clear()
        self.compiled[key] = (compiled, tuple(meta[name] for name in constexprs))
