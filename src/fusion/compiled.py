"""One op of the model under torch.compile, the rest eager: what `kernels.compiled` applies, where
kernels=auto measured compile as the fastest variant of that op (src/fusion/measure.py).

Each swap keeps the module's Parameter objects, as the fused Triton swaps do, so FSDP2 shards the
same tensors and state dicts keep their keys. Compiling an op alone, not its block, leaves FSDP2's
per-block hooks and the GEMMs as they are: the choice is about the op.
"""
from __future__ import annotations

import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.fusion.ops import OPS, load


def _rms_norm(x, weight, eps):
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def _add_rms_norm(x, residual, weight, eps):
    s = x + residual
    return s, F.rms_norm(s, (s.shape[-1],), weight, eps)


def _silu_mul(g, u):
    return F.silu(g) * u


@functools.cache
def _compiled(fn):
    """torch.compile(fn), made on first use: importing torch._dynamo costs ~2.5 s, which every
    run's settings check (src/config/validate.py reads COMPILABLE) would otherwise pay."""
    return torch.compile(fn, dynamic=False)


def _compiled_rms_norm(x, weight, eps):
    return _compiled(_rms_norm)(x, weight, eps)


def _compiled_add_rms_norm(x, residual, weight, eps):
    return _compiled(_add_rms_norm)(x, residual, weight, eps)


def _compiled_silu_mul(g, u):
    return _compiled(_silu_mul)(g, u)


class CompiledRMSNorm(nn.Module):
    """nn.RMSNorm's forward under torch.compile, and the residual add fused into it (add_forward)."""

    def __init__(self, norm: nn.RMSNorm):
        super().__init__()
        self.eps = norm.eps if norm.eps is not None else torch.finfo(torch.float32).eps
        self.weight = norm.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return _compiled_rms_norm(x, self.weight, self.eps)

    def add_forward(self, x: torch.Tensor, residual: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _compiled_add_rms_norm(x, residual, self.weight, self.eps)


class CompiledSiLUMul(nn.Module):
    def forward(self, g: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
        return _compiled_silu_mul(g, u)


def _compiled_cross_entropy(logits, targets, label_smoothing: float = 0.0):
    return _compiled(F.cross_entropy)(logits, targets, label_smoothing=label_smoothing)


def compiled_cross_entropy(logits, targets, label_smoothing: float = 0.0):
    return _compiled_cross_entropy(logits, targets, label_smoothing=label_smoothing)


def _swap_rms_norm(model: nn.Module) -> int:
    from src.fusion.registry import swap_modules

    return swap_modules(model, lambda m: isinstance(m, nn.RMSNorm), CompiledRMSNorm)


def _swap_swiglu(model: nn.Module) -> int:
    from src.fusion.registry import swap_modules
    from src.models.layers import SiLUMul

    return swap_modules(model, lambda m: isinstance(m, SiLUMul), lambda m: CompiledSiLUMul())


COMPILABLE = tuple(op.name for op in OPS if op.compiled is not None)


def apply_compiled(model: nn.Module, ops: list[str]) -> tuple[dict[str, int], object | None]:
    """Swap the modules of `ops` for compiled ones, in place; returns (op -> modules swapped, the
    compiled loss function or None)."""
    unknown = [op for op in ops if op not in COMPILABLE]
    if unknown:
        raise ValueError(f"kernels.compiled={unknown}: no compiled variant; there are: {', '.join(COMPILABLE)}")
    chosen = [op for op in OPS if op.name in ops]
    swapped = {op.name: load(op.compiled.modules)(model) for op in chosen if op.compiled.modules}
    losses = [load(op.compiled.loss) for op in chosen if op.compiled.loss]
    return swapped, losses[0] if losses else None
