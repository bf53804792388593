"""The contract between a model and the code that lays it on GPUs, speeds it up and exports it.

parallelize (src/distributed/parallelize.py), float8 (src/distributed/float8.py), the fused-kernel
swaps and kernels=auto (src/fusion/), checkpoints (src/train/checkpoint.py), FLOP counting
(src/train/metrics.py) and edge export (src/edge/) read a model only through what is written here,
so an architecture is a folder of its own under src/models/ plus a conf/model/*.yaml.
"""
from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as a plain nn.Module (constructor arguments only, no config object).

    embed:  nn.Embedding, tokens -> (B, T, dim)
    layers: nn.ModuleList of the transformer blocks: each is one FSDP2 unit and one torch.compile
            region, and its nn.Linear layers are the ones float8 converts; a block's forward takes the
            residual stream (B, T, dim) first, and returns it; what the model's forward hands every
            block after it (LLaMA's rotary table) is optional: a block called on x alone makes it
    head:   the output projection, an nn.Linear (dim -> vocab, no bias) that may share embed's weight;
            the fused linear + cross-entropy swaps it for a module with `loss(x, targets)`
    """

    embed: nn.Embedding
    layers: nn.ModuleList
    head: nn.Module

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); given targets and a head with a fused `loss`, the mean loss."""
        ...

    def param_init(self, name: str) -> tuple[str, float]:
        """How parameter `name` (as named_parameters gives it) is initialised: ("ones" | "zeros" |
        "normal", std); kept as data so sharded code draws each full tensor from a seeded generator."""
        ...

    def num_params(self, non_embedding: bool = True) -> int:
        """Parameters, each shared tensor once; non_embedding leaves the token embedding out."""
        ...

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs a token (forward and backward) at `seq_len`, torchtitan's count: 6 x the
        parameters each token multiplies (the head's included, tied or not), plus
        attention_flops_per_token."""
        ...

    def attention_flops_per_token(self, seq_len: int) -> float:
        """Attention's share of flops_per_token, counted whole: 12 x layers x query heads x head_dim x
        seq_len (a causal mask skips about half of it, which Megatron-Bridge's count leaves out)."""
        ...

    def tie_weights(self) -> None:
        """Share the weights the architecture ties (the head and the embedding) again after `to_empty`,
        which allocates each module's tensors apart; nothing where none are tied."""
        ...

    def new_block(self) -> nn.Module:
        """A fresh block like those in `layers` (its own parameters, not initialised), for timing one
        block alone (kernels=auto)."""
        ...
