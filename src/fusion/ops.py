"""The ops of kernels/triton, one row each: what the registry swaps in (registry.py), what
task=kernel_bench and kernels=auto time (cases.py, measure.py), what runs under torch.compile on
its own (compiled.py), which profiled kernels a diagnosis hands to it (src/profiling/diagnosis.py)
and the kernel_bench defaults (src/config/tasks.py) are all read from here. A new kernel is its file
in kernels/triton/, one row below, and one test (tests/unit/test_ops.py checks every row).

Plain data: code is named by "module:attr" strings and imported on use (`load`), so that the config
layer reads this table without importing torch or triton.
"""
from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass


@dataclass(frozen=True)
class Bench:
    """One entry point of an op's kernel, timed alone against its PyTorch reference."""

    name: str
    """kernel_bench.ops' name, and the case measure.py times a model's use of the op by"""
    make: str
    """(name, shape) -> cases.Case: the inputs, and the bytes (or FLOPs) the op must move"""
    eager: str
    """the PyTorch reference: the ops the model runs"""
    triton: str
    """the fused kernel, called as the reference is"""
    shapes: tuple[tuple[int, ...], ...]
    """kernel_bench.shapes' default"""
    dims: tuple[str, ...] = ("rows", "width")
    """what each size of a shape is"""
    liger: str = ""
    """() -> Liger-Kernel's variant (ImportError where not installed); empty: Liger has none"""
    gradient_in_forward: bool = False
    """the fused variant computes the gradient in the forward pass: its backward alone times next to nothing"""


@dataclass(frozen=True)
class Swap:
    """How a model gets a variant of an op: its modules replaced in place, or the step's loss function."""

    modules: str = ""
    """(model) -> how many modules were swapped"""
    loss: str = ""
    """the loss function the training step calls instead of F.cross_entropy"""


@dataclass(frozen=True)
class Op:
    name: str
    """the op kernels.fused, kernels.compiled and a diagnosis's `fusion` name"""
    kernel: str
    """the module of kernels/triton that holds its kernels"""
    triton: Swap | None = None
    """kernels=triton's swap (registry.py); None: not a swap of the model (AdamW: optim.impl=triton)"""
    compiled: Swap | None = None
    """kernels.compiled's swap: the op alone under torch.compile (compiled.py); None: none"""
    benches: tuple[Bench, ...] = ()
    measured: str = ""
    """(cfg) -> list[measure.Use]: how the model uses the op a step, as kernels=auto times it; empty: never timed"""
    diagnosed: tuple[tuple[str, str], ...] = ()
    """(profiled op of src/profiling/categories.py, the remedy as a person calls it): the kernels a
    diagnosis hands to this op where fusion is their remedy"""
    in_block: bool = False
    """runs inside a transformer block: a compiled block subsumes its pick"""
    loss: bool = False
    """computes the loss: kernels=auto times it with the output head"""
    max_dim: int = 0
    """widest row one program holds in registers (0: rows are walked in blocks, no limit)"""
    loss_in_model: bool = False
    """the swap moves the loss into the model's forward (model(inputs, targets) returns it)"""
    replaces: tuple[str, ...] = ()
    """ops this one subsumes when both are chosen"""


_CASES = "src.fusion.cases"
_REGISTRY = "src.fusion.registry"
_COMPILED = "src.fusion.compiled"
_MEASURE = "src.fusion.measure"

# Bench shapes are an LLM's: a batch's tokens at LLaMA-7B's and mini_llm's widths (the SwiGLU hidden
# is LLaMA-7B's), the seed's vocabulary, softmax over the keys of attention scores written out.
OPS: tuple[Op, ...] = (
    Op(
        "rms_norm", "perflab_kernels.triton.rms_norm",
        triton=Swap(modules=f"{_REGISTRY}:_swap_rms_norm"),
        compiled=Swap(modules=f"{_COMPILED}:_swap_rms_norm"),
        benches=(
            Bench("rms_norm", f"{_CASES}:rms_norm_case", f"{_CASES}:eager_rms_norm", "perflab_kernels.triton.rms_norm:fused_rms_norm",
                  ((8192, 2048), (8192, 4096)), liger=f"{_CASES}:liger_rms_norm"),
            Bench("add_rms_norm", f"{_CASES}:add_rms_norm_case", f"{_CASES}:eager_add_rms_norm",
                  "perflab_kernels.triton.rms_norm:fused_add_rms_norm", ((8192, 2048),)),
        ),
        measured=f"{_MEASURE}:norm_uses",
        diagnosed=(("rms_norm", "fused Triton RMSNorm (+ residual add)"), ("add", "residual add fused into Triton RMSNorm")),
        in_block=True, max_dim=65536,
    ),
    Op(
        "swiglu", "perflab_kernels.triton.swiglu",
        triton=Swap(modules=f"{_REGISTRY}:_swap_swiglu"),
        compiled=Swap(modules=f"{_COMPILED}:_swap_swiglu"),
        benches=(Bench("swiglu", f"{_CASES}:swiglu_case", f"{_CASES}:eager_swiglu", "perflab_kernels.triton.swiglu:fused_swiglu",
                       ((8192, 8192), (8192, 11008)), liger=f"{_CASES}:liger_swiglu"),),
        measured=f"{_MEASURE}:swiglu_uses",
        diagnosed=(("silu", "fused Triton SiLU-mul"), ("mul", "fused Triton SiLU-mul")),
        in_block=True,
    ),
    Op(
        "softmax", "perflab_kernels.triton.softmax",
        triton=Swap(modules=f"{_REGISTRY}:_swap_softmax"),
        benches=(Bench("softmax", f"{_CASES}:softmax_case", f"{_CASES}:eager_softmax", "perflab_kernels.triton.softmax:fused_softmax",
                       ((8192, 4096),)),),
        # not measured: attention's softmax runs inside scaled_dot_product_attention, no module to swap
        diagnosed=(("softmax", "fused Triton softmax"),),
        in_block=True, max_dim=65536,
    ),
    Op(
        "cross_entropy", "perflab_kernels.triton.cross_entropy",
        triton=Swap(loss=f"{_REGISTRY}:_fused_cross_entropy"),
        compiled=Swap(loss=f"{_COMPILED}:compiled_cross_entropy"),
        benches=(Bench("cross_entropy", f"{_CASES}:cross_entropy_case", f"{_CASES}:eager_cross_entropy",
                       "perflab_kernels.triton.cross_entropy:fused_cross_entropy", ((8192, 32000),),
                       liger=f"{_CASES}:liger_cross_entropy", gradient_in_forward=True),),
        measured=f"{_MEASURE}:head_loss_uses",
        diagnosed=(("cross_entropy", "fused Triton cross-entropy (loss and gradient in one pass)"),),
        loss=True,
    ),
    Op(
        "linear_cross_entropy", "perflab_kernels.triton.linear_cross_entropy",
        triton=Swap(modules=f"{_REGISTRY}:_swap_head"),
        benches=(Bench("linear_cross_entropy", f"{_CASES}:linear_cross_entropy_case", f"{_CASES}:eager_linear_cross_entropy",
                       "perflab_kernels.triton.linear_cross_entropy:fused_linear_cross_entropy", ((8192, 2048, 32000),),
                       dims=("tokens", "dim", "vocab"), liger=f"{_CASES}:liger_linear_cross_entropy", gradient_in_forward=True),),
        measured=f"{_MEASURE}:head_loss_uses",
        # a diagnosis names cross_entropy; kernels=auto times this one as that op's candidate
        loss=True, loss_in_model=True, replaces=("cross_entropy",),
    ),
    Op(
        "adamw", "perflab_kernels.triton.adamw",
        # optim.impl=triton, not a swap: kernels=auto times it against torch's fused AdamW
        measured=f"{_MEASURE}:optimizer_uses",
        diagnosed=(("adamw", "AdamW in one Triton launch, the grad norm read in its pass (optim.impl=triton; "
                             "kernels=auto times it against torch's fused AdamW)"),),
    ),
)

BENCHES: tuple[Bench, ...] = tuple(b for op in OPS for b in op.benches)


def op_named(name: str) -> Op | None:
    return next((op for op in OPS if op.name == name), None)


def bench_named(name: str) -> Bench | None:
    return next((b for b in BENCHES if b.name == name), None)


@functools.cache
def load(ref: str):
    """The object a "module:attr" string names, its module imported on first use."""
    module, _, attr = ref.partition(":")
    found = importlib.import_module(module)
    for part in attr.split("."):
        found = getattr(found, part)
    return found
