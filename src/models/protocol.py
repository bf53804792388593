"""The contract between a model and the code that lays it on GPUs, speeds it up and exports it.

parallelize (src/distributed/parallelize.py), float8 (src/distributed/float8.py), the fused-kernel
swaps and kernels=auto (src/fusion/), checkpoints (src/train/checkpoint.py), FLOP counting
(src/train/metrics.py), the memory estimate (src/memory_estimate.py) and edge export (src/edge/)
read a model only through what is written here (CausalLM, Block, Attention), and find an
architecture only through its Architecture; so an architecture is a folder of its own under
src/models/ (config.py, model.py, architecture.py, checks.py, hf.py) plus a conf/model/*.yaml.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol, runtime_checkable

import torch
import torch.nn as nn
from omegaconf import DictConfig


@runtime_checkable
class Attention(Protocol):
    """A block's `attn`.

    n_heads, n_kv_heads, head_dim: query heads, the key/value heads they share, a head's width (the
        memory estimate's saved activations, the edge KV cache's shape)
    out_proj: the nn.Linear from the heads back to the residual stream (edge export calls it)
    """

    n_heads: int
    n_kv_heads: int
    head_dim: int
    out_proj: nn.Linear

    def heads(self, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, n_heads, T, head_dim), k and v (B, n_kv_heads, T, head_dim) of the normed input `x`
        at `positions` (T,), position-encoded as a KV cache keeps them: edge export's attention is
        matmul -> masked softmax -> matmul over these, then out_proj."""
        ...


@runtime_checkable
class Block(Protocol):
    """One of CausalLM.layers: pre-norm, x + attn(norm1(x)), then + ffn(norm2(.)).

    norm1, norm2: nn.RMSNorm (the fused RMSNorm, and the add + norm of norm2, swap them by name)
    attn:  an Attention
    ffn:   an MLP whose last nn.Linear is `down` (its in_features: the hidden width); a SwiGLU MLP
           has `gate`, `up` and `act` (SiLUMul: the fused SwiGLU and float8's fp8_swiglu swap it),
           the seed's SiLU MLP `up`, `act` and `down`
    Every nn.Linear under a block is one float8 converts; a block is one FSDP2 unit, one activation
    checkpoint region and one torch.compile region.
    """

    norm1: nn.Module
    attn: Attention
    norm2: nn.Module
    ffn: nn.Module

    def forward(self, x: torch.Tensor, *attn_args) -> torch.Tensor:
        """The residual stream (B, T, dim) in and out; `attn_args` (LLaMA's rotary table) go to attn."""
        ...


class HFAdapter(Protocol):
    """An architecture's Hugging Face checkpoints (src/models/ARCH/hf.py), in and out."""

    def check(self, model_cfg: DictConfig, folder: Path) -> str | None:
        """Why the folder cannot start `model_cfg`'s model (another shape, a missing, cut-off or
        quantized tensor), in one line; None where it can. Reads config.json and the files' headers."""
        ...

    def load(self, model: nn.Module, folder: Path) -> int:
        """Copy the folder's weights into `model` (plain or FSDP2-sharded, each rank its own rows);
        the number of parameters filled."""
        ...

    def save(self, model: nn.Module, model_cfg: dict, state: dict[str, torch.Tensor], folder: Path) -> Path:
        """Write `state` (the full state dict, plain tensors) as a folder transformers loads."""
        ...


@dataclass(frozen=True)
class Architecture:
    """What src/models/ARCH/architecture.py names: the rest of the code finds an architecture here."""

    model: type[nn.Module]
    """the CausalLM class, built from the model.* fields its constructor names"""
    refusal: Callable[[DictConfig], str | None]
    """its own settings checks (src/models/ARCH/checks.py): one line, or None"""
    hf: HFAdapter | None = None
    """its Hugging Face checkpoints (model.hf_path, export --hf); None: it has none"""


@runtime_checkable
class CausalLM(Protocol):
    """A decoder-only language model as a plain nn.Module (constructor arguments only, no config object).

    embed:  nn.Embedding, tokens -> (B, T, dim)
    layers: nn.ModuleList of Blocks; what the model's forward hands every block after x (LLaMA's
            rotary table) is optional: a block called on x alone makes it
    head:   the output projection, an nn.Linear (dim -> vocab, no bias) that may share embed's weight;
            the fused linear + cross-entropy swaps it for a module with `loss(x, targets)`
    norm:   (optional) the norm before the head (LLaMA's; MiniLLM has none)
    tie_embeddings: (optional) whether head and embed share one weight
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
