"""Which ops have fused Triton variants, what each needs, and how a model gets them.

`apply_fused(model, ops)` swaps modules in place before sharding, keeping every Parameter object,
so FSDP2 shards the same tensors and state dicts keep their keys; the fused kernels then run on
the unsharded tensors FSDP2 gathers for each block's forward and backward.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Callable

import torch.nn as nn


@dataclass(frozen=True)
class FusedVariant:
    op: str
    """the op name a diagnosis uses (src/profiling/diagnosis.py FUSIONS)"""
    swap: Callable[[nn.Module], int] | None = None
    """replace the eager modules of `model` in place; returns how many were swapped"""
    loss: Callable | None = None
    """or: the loss function the training step calls instead of F.cross_entropy"""
    max_dim: int = 0
    """widest row one program holds in registers (0: rows are walked in blocks, no limit)"""


def _swap_rms_norm(model: nn.Module) -> int:
    from kernels.triton.rms_norm import FusedRMSNorm

    swapped = 0
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if isinstance(child, nn.RMSNorm):
                setattr(parent, name, FusedRMSNorm.from_module(child))
                swapped += 1
    return swapped


def _fused_cross_entropy(logits, targets):
    from kernels.triton.cross_entropy import fused_cross_entropy

    return fused_cross_entropy(logits, targets)


REGISTRY: dict[str, FusedVariant] = {
    "rms_norm": FusedVariant("rms_norm", swap=_swap_rms_norm, max_dim=65536),
    "cross_entropy": FusedVariant("cross_entropy", loss=_fused_cross_entropy),
}


def triton_usable(device_type: str) -> str | None:
    """None if Triton kernels can run here, else why not."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return "Triton is not installed (pip install triton)"
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return "Triton kernels need an NVIDIA GPU (backend=cuda); on a CPU they run only in Triton's interpreter (TRITON_INTERPRET=1, slow)"


def selected_ops(fused: list[str] | None) -> list[str]:
    """`kernels.fused`: null means every registered variant, a list names some, [] none."""
    return list(REGISTRY) if fused is None else list(fused)


def apply_fused(model: nn.Module, ops: list[str] | None = None) -> tuple[dict[str, int], Callable | None]:
    """Swap in the fused variants of `ops` (all registered ones when None). Returns op -> modules
    swapped, and the fused loss function if one was chosen (else None: F.cross_entropy)."""
    chosen = list(REGISTRY) if ops is None else ops
    unknown = [op for op in chosen if op not in REGISTRY]
    if unknown:
        raise ValueError(f"no fused Triton variant for {', '.join(unknown)}; there are: {', '.join(REGISTRY)}")
    swapped = {op: REGISTRY[op].swap(model) for op in chosen if REGISTRY[op].swap is not None}
    losses = [REGISTRY[op].loss for op in chosen if REGISTRY[op].loss is not None]
    return swapped, (losses[0] if losses else None)
