"""AdamW as optim.impl asks: fused, foreach, for_loop or triton kernels (the same update, other launches).

AdamW is a visible share of device kernel time in the seed's step, and the implementations differ
in how they launch it: for_loop launches each elementwise op of the update per parameter, foreach
per batch of parameters (multi_tensor_apply), fused the whole update in one kernel per batch,
triton the whole update of every parameter in one launch with the gradients' sum of squares on the
way (kernels/triton/adamw.py), so a logged step's gradient norm needs no second pass over the
gradients. Each rank's host memory is logged per step (host_rss_mb), so a leak of one
implementation (fused AdamW over DTensor parameters on torch 2.10/2.11) shows as host_rss_growth_mb.
"""
from __future__ import annotations

import torch
from omegaconf import DictConfig


def optimizer_impl(impl: str, device_type: str, cpu_offload: bool) -> str:
    """optim.impl=auto: fused on CUDA; foreach elsewhere, and for parameters offloaded to host
    memory (what the default was before optim.impl: fused only for CUDA parameters)."""
    if impl != "auto":
        return impl
    return "fused" if device_type == "cuda" and not cpu_offload else "foreach"


def build_optimizer(params, o: DictConfig, device_type: str, cpu_offload: bool, seed: int = 0) -> torch.optim.AdamW:
    """AdamW as `o` (the optim group) asks; `seed` (train.seed) keys the stochastic rounding of
    bf16 moments (optim.state_dtype=bfloat16, impl=triton only: src/train/checks.py refuses others)."""
    impl = optimizer_impl(o.impl, device_type, cpu_offload)
    if impl == "triton":
        from perflab_kernels.triton.adamw import (
            TritonAdamW,  # Triton only where asked: the other kinds train without it
        )

        return TritonAdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay,
                           state_dtype=getattr(torch, o.state_dtype), seed=seed)
    kernels = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **kernels)


def norm_in_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` can leave the global grad norm behind (TritonAdamW's
    grad_norm_wanted and last_grad_norm)."""
    return hasattr(optimizer, "grad_norm_wanted")
