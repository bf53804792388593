"""task=kernel_bench's own settings checks (src/config/validate.py runs them): ops, providers, modes, dtype
and shapes, and whether Triton can run them here at these sizes."""
from __future__ import annotations

import math

from omegaconf import DictConfig

from src.config.compose import ConfigError
from src.config.tasks import BenchMode
from src.fusion.ops import bench_named
from src.fusion.registry import interpreted, triton_usable

KERNELS_ON_CPU = "TRITON_INTERPRET=1 python -m src.run +exp=kernels_cpu"
_INTERPRETER_MAX_ELEMENTS = 1 << 20  # a [64, 256] row takes ~1 s in the interpreter; [8192, 4096] ~90 s


def check_kernel_bench(cfg: DictConfig, backend: str, cuda_device_count: int) -> None:
    from src.dtypes import TORCH_DTYPES
    from src.fusion.cases import OPS

    b = cfg.kernel_bench
    if backend not in ("cpu", "cuda"):
        raise ConfigError(f"task=kernel_bench times kernels on backend=cuda (or backend=cpu to check the plumbing), not backend={backend}")
    if backend == "cuda" and cuda_device_count == 0:
        raise ConfigError(f"backend=cuda but no CUDA GPU is visible; +exp=kernels times kernels on an NVIDIA GPU; on a CPU, check the plumbing with `{KERNELS_ON_CPU}`")
    for name, given, allowed in (("ops", b.ops, OPS), ("providers", b.providers, ("eager", "compile", "triton", "liger")), ("modes", b.modes, tuple(BenchMode))):
        unknown = [v for v in given if v not in allowed]
        if unknown or not given:
            raise ConfigError(f"kernel_bench.{name}={list(given)}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; choose from {', '.join(allowed)}")
    if b.dtype not in TORCH_DTYPES:
        raise ConfigError(f"kernel_bench.dtype={b.dtype}: one of {', '.join(TORCH_DTYPES)}")
    for op in b.ops:
        dims = bench_named(op).dims
        shapes = b.shapes.get(op)
        if not shapes or any(len(s) != len(dims) or min(s) < 1 for s in shapes):
            form = f"[{', '.join(dims)}]"
            raise ConfigError(f"kernel_bench.shapes.{op}={None if shapes is None else [list(s) for s in shapes]}: give a list of {form} with positive sizes")
    if "triton" in b.providers:
        why_not = triton_usable(backend)
        if why_not and backend == "cpu" and not interpreted():
            raise ConfigError(f"kernel_bench.providers has triton, which runs on a CPU only in Triton's interpreter: `{KERNELS_ON_CPU}`")
        if why_not:
            raise ConfigError(f"kernel_bench.providers has triton: {why_not}; or drop it from kernel_bench.providers")
        largest = max(math.prod(s) for op in b.ops for s in b.shapes[op])
        if backend == "cpu" and largest > _INTERPRETER_MAX_ELEMENTS:
            raise ConfigError(f"kernel_bench.shapes at these sizes take minutes a row in Triton's interpreter "
                              f"(LLM sizes: 2 rows in 180 s); use the small sizes of `{KERNELS_ON_CPU}`")
