"""What `task=kernel_bench` and kernels=auto (measure.py) time: per op, its inputs, the bytes it must move, and its variants.

Effective bandwidth counts each input read once and each output written once (the least any
kernel must move), over the measured time: the figure to hold against the device's copy ceiling.
For forward + backward that is forward's bytes plus backward's (it reads the output gradient and
what forward saved, writes the input and weight gradients). The fused linear + cross-entropy is
GEMM-bound, so it is reported in TFLOP/s (2 N D V forward, 4 N D V backward) and peak memory.

Variants: eager (the PyTorch ops the model runs), compile (torch.compile of eager), triton
(kernels/triton) and liger (Liger-Kernel, when installed: the outside reference).
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from src.fusion.ops import BENCHES, Bench, bench_named, load

EPS = 1e-6
OPS = tuple(b.name for b in BENCHES)
"""kernel_bench's ops, in the op table's order"""
# ops whose fused variants compute the gradient in the forward pass: their backward alone times next to nothing
GRADIENT_IN_FORWARD = tuple(b.name for b in BENCHES if b.gradient_in_forward)


@dataclass
class Case:
    """One op at one shape: inputs made fresh per variant, and how each variant runs."""

    op: str
    shape: tuple[int, ...]
    inputs: Callable[[torch.device, torch.dtype, bool], list[torch.Tensor]]
    """(device, dtype, requires_grad) -> the op's tensors"""
    bytes_fwd: Callable[[int], int]
    """element size -> bytes forward must move"""
    bytes_bwd: Callable[[int], int]
    flops_fwd: int = 0
    """for GEMM-bound ops, reported as TFLOP/s instead of TB/s"""
    flops_bwd: int = 0


def _bench(op: str) -> Bench:
    found = bench_named(op)
    if found is None:
        raise ValueError(f"kernel_bench.ops: unknown {op!r}; use {', '.join(OPS)}")
    return found


def _eager(op: str) -> Callable:
    return load(_bench(op).eager)


def _triton(op: str) -> Callable:
    return load(_bench(op).triton)


def _liger(op: str) -> Callable | None:
    """Liger-Kernel's variant of `op`, or None (not installed, or no such kernel in this version)."""
    ref = _bench(op).liger
    try:
        return load(ref)() if ref else None
    except ImportError:
        return None


def eager_rms_norm(x, w):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def eager_add_rms_norm(x, r, w):
    s = x + r
    return s, F.rms_norm(s, (s.shape[-1],), w, EPS)


def eager_swiglu(g, u):
    return F.silu(g) * u


def eager_softmax(x):
    return torch.softmax(x, dim=-1)


def eager_cross_entropy(logits, t):
    return F.cross_entropy(logits, t)


def eager_linear_cross_entropy(h, w, t):
    return F.cross_entropy((h @ w.t()).float(), t)


def liger_rms_norm() -> Callable:
    from liger_kernel.ops.rms_norm import LigerRMSNormFunction

    return lambda x, w: LigerRMSNormFunction.apply(x, w, EPS)


def liger_swiglu() -> Callable:
    from liger_kernel.ops.swiglu import LigerSiLUMulFunction

    return LigerSiLUMulFunction.apply


def liger_cross_entropy() -> Callable:
    from liger_kernel.transformers import LigerCrossEntropyLoss

    return LigerCrossEntropyLoss()


def liger_linear_cross_entropy() -> Callable:
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    loss = LigerFusedLinearCrossEntropyLoss()
    return lambda h, w, t: loss(w, h, t)


def variant(op: str, provider: str) -> Callable | None:
    if provider == "eager":
        return _eager(op)
    if provider == "compile":
        return torch.compile(_eager(op), dynamic=False)
    if provider == "triton":
        return _triton(op)
    if provider == "liger":
        return _liger(op)
    raise ValueError(f"kernel_bench.providers: unknown {provider!r}; use eager, compile, triton, liger")


_GENERATORS: dict[torch.device, torch.Generator] = {}


def _generator(device) -> torch.Generator:
    """A generator of the bench's own, seeded per device: a CUDA graph capture that fails (eager
    RMSNorm's backward on torch 2.11) leaves the default CUDA generator unusable for the process."""
    device = torch.device(device)
    if device not in _GENERATORS:
        _GENERATORS[device] = torch.Generator(device)
    return _GENERATORS[device]


def seed(device, value: int = 0) -> None:
    _generator(device).manual_seed(value)


def _randn(shape, device, dtype, grad, scale=1.0, shift=0.0):
    """A leaf tensor: the shift is applied before requires_grad_, so backward writes its .grad (a
    shifted tensor would be a non-leaf whose gradient flows on into a hidden one)."""
    x = torch.randn(shape, device=device, dtype=torch.float32, generator=_generator(device))
    return (x * scale + shift).to(dtype).requires_grad_(grad)


def _randint(high, shape, device):
    return torch.randint(0, high, shape, device=device, generator=_generator(device))


def make_case(op: str, shape: list[int]) -> Case:
    """`shape` is rows x width for the row ops, tokens x dim x vocab for linear_cross_entropy
    (the op's `dims` in src/fusion/ops.py)."""
    bench = _bench(op)
    shape = tuple(int(s) for s in shape)
    if len(shape) != len(bench.dims):
        raise ValueError(f"{op} shapes are [{', '.join(bench.dims)}], got {list(shape)}")
    return load(bench.make)(op, shape)


def linear_cross_entropy_case(op: str, shape: tuple[int, ...]) -> Case:
    n, d, v = shape
    return Case(
        op, shape,
        lambda dev, dt, g: [_randn((n, d), dev, dt, g), _randn((v, d), dev, dt, g, d**-0.5), _randint(v, (n,), dev)],
        lambda s: (n * d + v * d) * s + 8 * n, lambda s: (n * d + v * d) * 2 * s,
        flops_fwd=2 * n * d * v, flops_bwd=4 * n * d * v,
    )


def rms_norm_case(op: str, shape: tuple[int, ...]) -> Case:
    m, n = shape
    mn = m * n
    return Case(op, shape, lambda dev, dt, g: [_randn((m, n), dev, dt, g), _randn((n,), dev, dt, g, 0.1, 1.0)],
                lambda s: (2 * mn + n) * s, lambda s: (3 * mn + 2 * n) * s)


def add_rms_norm_case(op: str, shape: tuple[int, ...]) -> Case:
    m, n = shape
    mn = m * n
    return Case(op, shape, lambda dev, dt, g: [_randn((m, n), dev, dt, g), _randn((m, n), dev, dt, g), _randn((n,), dev, dt, g, 0.1, 1.0)],
                lambda s: (4 * mn + n) * s, lambda s: (4 * mn + 2 * n) * s)  # bwd: dy, ds, s in; dx out (= dr)


def swiglu_case(op: str, shape: tuple[int, ...]) -> Case:
    m, n = shape
    mn = m * n
    return Case(op, shape, lambda dev, dt, g: [_randn((m, n), dev, dt, g), _randn((m, n), dev, dt, g)],
                lambda s: 3 * mn * s, lambda s: 5 * mn * s)


def softmax_case(op: str, shape: tuple[int, ...]) -> Case:
    m, n = shape
    mn = m * n
    return Case(op, shape, lambda dev, dt, g: [_randn((m, n), dev, dt, g, 4.0)],
                lambda s: 2 * mn * s, lambda s: 3 * mn * s)


def cross_entropy_case(op: str, shape: tuple[int, ...]) -> Case:
    m, n = shape
    mn = m * n
    return Case(op, shape, lambda dev, dt, g: [_randn((m, n), dev, dt, g, 4.0), _randint(n, (m,), dev)],
                # the fused variants write the gradient into the logits: later timed runs do the
                # same work on other values (the error check uses the first, on fresh inputs)
                lambda s: mn * s + 8 * m, lambda s: mn * s)


# ops whose fused variants compute the gradient in the forward pass: their backward alone times next to nothing
GRADIENT_IN_FORWARD = ("cross_entropy", "linear_cross_entropy")


def output_of(result) -> torch.Tensor:
    """The tensor to compare across variants (the normalised output of add + RMSNorm)."""
    return result[-1] if isinstance(result, tuple) else result


def max_rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    want = want.float()
    scale = want.abs().max().item() or 1.0
    return (got.float() - want).abs().max().item() / scale if math.isfinite(scale) else math.nan


def forward_backward(fn: Callable, inputs: list[torch.Tensor], first=None, *, backward_only: bool = False) -> Callable[[], None]:
    """One forward and backward of `fn(*inputs)` as a call with no arguments, for the timers; with
    `backward_only`, the backward alone: the forward runs once, here, and each call runs the
    backward over its graph again (retain_graph).

    The output gradients are ones: the kernels move the same bytes whatever the values, and a
    CUDA graph capture that fails (eager RMSNorm's backward on torch 2.11) leaves the default CUDA
    generator unusable, so nothing after the inputs may draw from it. autograd.grad, not backward:
    the gradients are returned, not accumulated into .grad, so no AccumulateGrad step differs
    between plain calls and a CUDA graph's replays. `first`: an output already computed, to shape
    the gradients without another forward (and, with `backward_only`, the graph to run backward)."""
    leaves = [t for t in inputs if t.requires_grad]
    first = fn(*inputs) if first is None else first
    outputs = list(first) if isinstance(first, tuple) else [first]
    grads = [torch.ones_like(o) for o in outputs]

    if backward_only:
        def run() -> None:
            torch.autograd.grad(outputs, leaves, grads, retain_graph=True)
        return run

    def run() -> None:
        result = fn(*inputs)
        torch.autograd.grad(list(result) if isinstance(result, tuple) else [result], leaves, grads)

    return run
