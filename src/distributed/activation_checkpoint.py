"""Activation checkpointing (`ac.mode`): a block's activations recomputed in backward instead of kept
from forward, trading compute for memory, as torchtitan's apply_ac does, before compile and FSDP2.

- full: every block keeps only its input; backward runs its forward again.
- selective, `ac.selective=N`: every Nth block is checkpointed in full, the others keep everything.
- selective, `ac.selective=op`: every block keeps the outputs of its expensive ops (matmuls,
  attention) and recomputes the cheap ones (norms, activations, casts), torchtitan's op-level policy;
  of the matmuls it keeps every other one, as torchtitan does, so the memory saved is not only the
  elementwise work's.

Each block's `forward` is wrapped in place (torch.utils.checkpoint, non-reentrant), so parameter
names, state dicts and checkpoints stay those of the plain model; torch.compile, applied after,
traces the checkpointed forward, and FSDP2's hooks stay outside it.
"""
from __future__ import annotations

import functools
from collections import defaultdict

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts


def _aten(*names: str) -> set:
    """The default overloads of those aten ops this torch has."""
    return {getattr(torch.ops.aten, n).default for n in names if getattr(torch.ops.aten, n, None) is not None}


_MATMULS = _aten("mm", "addmm", "bmm", "_scaled_mm")
# ops whose outputs `op` keeps: what costs FLOPs to recompute (torchtitan's _save_list, less the collectives)
_KEEP = _MATMULS | _aten("_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention",
                         "_scaled_dot_product_cudnn_attention", "_scaled_dot_product_flash_attention_for_cpu")


def _op_policy():
    """A block's policy: keep _KEEP's outputs but every second matmul's. The matmuls are counted apart
    in forward and in its recompute, over the run (torchtitan's way), so both make the same choices
    as long as every forward is followed by its backward."""
    counts: dict[str, int] = defaultdict(int)

    def policy(ctx, op, *args, **kwargs) -> CheckpointPolicy:
        mode = "recompute" if ctx.is_recompute else "forward"
        if op in _MATMULS:
            counts[mode] += 1
            if counts[mode] % 2 == 0:  # every other matmul recomputed, as torchtitan's policy
                return CheckpointPolicy.PREFER_RECOMPUTE
        return CheckpointPolicy.MUST_SAVE if op in _KEEP else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def _checkpointed(forward, selective_ops: bool):
    # a functools.partial, which Dynamo can trace as the checkpoint's context_fn (a closure it cannot)
    context = functools.partial(create_selective_checkpoint_contexts, _op_policy()) if selective_ops else None

    @functools.wraps(forward)
    def run(*args, **kwargs):
        if context is not None:
            return checkpoint(forward, *args, use_reentrant=False, context_fn=context, **kwargs)
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)

    return run


def apply_activation_checkpointing(model: nn.Module, mode: str, selective: str = "op") -> int:
    """Wrap the blocks of `model.layers` as `mode` says (none, full, selective with `selective` = op or
    an N: every Nth block); returns how many blocks were wrapped."""
    if mode == "none":
        return 0
    every = 1 if mode == "full" or selective == "op" else int(selective)
    ops = mode == "selective" and selective == "op"
    wrapped = 0
    for i, block in enumerate(model.layers):
        if (i + 1) % every == 0:
            block.forward = _checkpointed(block.forward, ops)
            wrapped += 1
    return wrapped
