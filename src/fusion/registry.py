"""Which ops have fused Triton variants, what each needs, and how a model gets them: the swap policy,
which knows the model's modules (src/models/) and the kernel library (kernels/triton/), so that the
kernels need not know any model.

Each op has three variants: eager (the model as written), compile (`kernels=compile`:
torch.compile per block) and triton (REGISTRY, the rows of src/fusion/ops.py with a swap, swapped in by `kernels=triton`, or by
`kernels=auto` for the ops a diagnosis marks memory-bound). The Triton variants need CUDA, or
Triton's interpreter (TRITON_INTERPRET=1) on a CPU, and some hold a row in registers (max_dim).

`apply_fused(model, ops)` swaps modules in place before sharding, keeping every Parameter object,
so FSDP2 shards the same tensors and state dicts keep their keys; the fused kernels then run on
the unsharded tensors FSDP2 gathers for each block's forward and backward.
"""
from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

import torch.nn as nn

from perflab_kernels.triton.device import interpreted
from src.fusion.ops import OPS, Op, load
from src.models.layers import SiLUMul


def swap_modules(model: nn.Module, match: Callable[[nn.Module], bool], make: Callable[[nn.Module], nn.Module]) -> int:
    """Replace every submodule that `match`es with `make(it)`, in place; returns how many."""
    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if match(child):
                setattr(parent, name, make(child))
                swapped += 1
    return swapped


def _swap_rms_norm(model: nn.Module) -> int:
    from perflab_kernels.triton.rms_norm import FusedRMSNorm

    # FusedRMSNorm also has add_forward: the block's residual add joins its second norm.
    return swap_modules(model, lambda m: isinstance(m, nn.RMSNorm), FusedRMSNorm.from_module)


def _swap_swiglu(model: nn.Module) -> int:
    from perflab_kernels.triton.swiglu import FusedSiLUMul

    return swap_modules(model, lambda m: isinstance(m, SiLUMul), lambda m: FusedSiLUMul())


def _swap_softmax(model: nn.Module) -> int:
    from perflab_kernels.triton.softmax import FusedSoftmax

    return swap_modules(model, lambda m: isinstance(m, nn.Softmax) and m.dim in (-1, None), lambda m: FusedSoftmax())


def _swap_head(model: nn.Module) -> int:
    from perflab_kernels.triton.linear_cross_entropy import LinearCrossEntropyHead

    head = getattr(model, "head", None)
    if not isinstance(head, nn.Linear) or head.bias is not None:
        return 0
    model.head = LinearCrossEntropyHead.from_module(head)
    return 1


def _fused_cross_entropy(logits, targets, label_smoothing: float = 0.0):
    from perflab_kernels.triton.cross_entropy import fused_cross_entropy

    return fused_cross_entropy(logits, targets, label_smoothing=label_smoothing)


REGISTRY: dict[str, Op] = {op.name: op for op in OPS if op.triton is not None}
"""op -> its row of the op table (src/fusion/ops.py), for the ops with a fused Triton swap"""


@dataclass
class FusedModel:
    swapped: dict[str, int]
    """op -> modules swapped (0: the model has none of that op)"""
    loss_fn: Callable | None = None
    """the fused loss for the training step, None for F.cross_entropy"""
    loss_in_model: bool = False
    """model(inputs, targets) returns the loss (the head and loss are fused)"""
    loss_beside_head: Callable | None = None
    """where the fused head came with a loss of its own chosen too (kernels=auto's head trial): that
    loss, for steps that compute the logits (the head's forward still gives them) and then the loss"""

    def describe(self) -> str:
        return ", ".join([f"{op} x{n}" for op, n in self.swapped.items()] + (["cross_entropy"] if self.loss_fn else []))


def _release(version: str) -> tuple[int, int]:
    """(major, minor) of a version string such as '3.6.0' or '2.4.0rc1'."""
    parts = re.findall(r"\d+", version)[:2]
    return int(parts[0]), int(parts[1]) if len(parts) > 1 else 0


def interpreter_fault() -> str | None:
    """Why Triton's interpreter cannot run the fused kernels with the triton and numpy installed,
    or None. Before triton 3.7 the interpreter turns a kernel's tensors into Python ints with
    int() of a 1-element array, which numpy 2.4 and later refuse: every kernel with a `range` over
    program ids failed mid-run with "InterpreterError: TypeError('only 0-dimensional arrays can be
    converted to Python scalars')" (triton-lang/triton#9171, fixed in 3.7.0)."""
    import triton

    try:
        import numpy
    except ImportError:
        return "Triton's interpreter needs numpy (pip install numpy)"
    if _release(triton.__version__) < (3, 7) and _release(numpy.__version__) >= (2, 4):
        return (f"Triton's interpreter in triton {triton.__version__} fails with numpy {numpy.__version__} (triton-lang/triton#9171, "
                "fixed in triton 3.7); pip install 'numpy<2.4' (or a torch whose triton is 3.7 or later)")
    return None


def triton_usable(device_type: str) -> str | None:
    """None if Triton kernels can run here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if interpreted():  # the interpreter runs the kernels whatever the device
        return interpreter_fault()
    if device_type == "cuda":
        return None
    return "Triton kernels need an NVIDIA GPU (backend=cuda); on a CPU they run only in Triton's interpreter (TRITON_INTERPRET=1, slow)"


def selected_ops(fused: list[str] | None) -> list[str]:
    """`kernels.fused`: null means every registered variant, a list names some, [] none."""
    return list(REGISTRY) if fused is None else list(fused)


def apply_fused(model: nn.Module, ops: list[str] | None = None, label_smoothing: float = 0.0) -> FusedModel:
    """Swap in the fused variants of `ops` (all registered ones when None), in place; a fused
    head + loss takes `label_smoothing` (the training step passes it to the other losses)."""
    chosen = list(REGISTRY) if ops is None else list(ops)
    unknown = [op for op in chosen if op not in REGISTRY]
    if unknown:
        raise ValueError(f"no fused Triton variant for {', '.join(unknown)}; there are: {', '.join(REGISTRY)}")
    subsumed = {r for op in chosen for r in REGISTRY[op].replaces}
    beside = [op for op in chosen if op in subsumed and REGISTRY[op].triton.loss]  # a loss chosen with the head that replaces it
    chosen = [op for op in chosen if op not in subsumed]
    swapped = {op: load(REGISTRY[op].triton.modules)(model) for op in chosen if REGISTRY[op].triton.modules}
    losses = [load(REGISTRY[op].triton.loss) for op in chosen if REGISTRY[op].triton.loss]
    in_model = any(REGISTRY[op].loss_in_model and swapped.get(op) for op in chosen)
    if in_model:
        model.head.label_smoothing = label_smoothing
    return FusedModel(swapped, None if in_model or not losses else losses[0], in_model,
                      load(REGISTRY[beside[0]].triton.loss) if in_model and beside else None)
