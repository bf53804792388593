"""docs/SEED.md's MiniLLM as a plain nn.Module: no config objects, no sharding, no kernels inside.

Pre-norm blocks: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)) with a SiLU MLP of 4x width (or
LLaMA's SwiGLU MLP with `mlp="swiglu"`), an untied output head. Attention keeps nn.MultiheadAttention's parameters (one qkv projection with
bias, an output projection with bias) so parameter counts match the seed's, but calls
scaled_dot_product_attention on (B, nh, T, hs) directly: that skips MHA's batch-first transposes
and lets the causal mask (which the seed lacks) be a flag.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.models.layers import (
    PreNormBlock,
    SiLUMul,
    SwiGLUFeedForward,
    add_norm,
    gpt2_init,
    logits_or_loss,
    split_projection,
)

__all__ = ["MLPS", "Attention", "FeedForward", "MiniLLM", "SiLUMul", "SwiGLUFeedForward", "TransformerBlock", "add_norm", "split_projection"]


class Attention(nn.Module):
    def __init__(self, dim: int, n_heads: int, causal: bool = True):
        super().__init__()
        if dim % n_heads:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}")
        self.n_heads = n_heads
        self.causal = causal
        self.in_proj = nn.Linear(dim, 3 * dim, bias=True)
        self.out_proj = nn.Linear(dim, dim, bias=True)

    @property
    def n_kv_heads(self) -> int:
        return self.n_heads  # every head its own keys and values

    @property
    def head_dim(self) -> int:
        return self.in_proj.in_features // self.n_heads

    def heads(self, x: torch.Tensor, positions: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v), each (B, n_heads, T, head_dim), as a KV cache keeps them (src/edge/model.py);
        `positions` goes unused: the seed's attention has no position embedding."""
        B, T, C = x.shape
        qkv = self.in_proj(x).view(B, T, 3, self.n_heads, C // self.n_heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hs)
        return q, k, v

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, T, C = x.shape
        # q, k, v split off the token axis and only then viewed as (B, nh, T, hs): backward's dq, dk
        # and dv (token-major, as the fused kernels write them) join back into in_proj's gradient in
        # one contiguous copy, or none (split_projection). permute(2, 0, 3, 1, 4).unbind(0), the same
        # views, stacks them head-major and then copies again to make them token-major.
        q, k, v = (t.view(B, T, self.n_heads, C // self.n_heads).transpose(1, 2) for t in split_projection(self.in_proj, x, 3))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C)
        return self.out_proj(y)


class FeedForward(nn.Module):
    """Linear -> SiLU -> Linear, no biases, as the seed's nn.Sequential."""

    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=False)
        self.act = nn.SiLU()
        self.down = nn.Linear(hidden, dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(self.act(self.up(x)))


MLPS = {"silu": FeedForward, "swiglu": SwiGLUFeedForward}


class TransformerBlock(PreNormBlock):
    def __init__(self, dim: int, n_heads: int, ffn_hidden: int, causal: bool = True, norm_eps: float = 1e-6, mlp: str = "silu"):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.attn = Attention(dim, n_heads, causal)
        self.norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn = MLPS[mlp](dim, ffn_hidden)


class MiniLLM(nn.Module):
    def __init__(
        self,
        vocab_size: int = 32000,
        dim: int = 2048,
        n_layers: int = 12,
        n_heads: int = 16,
        ffn_mult: int = 4,
        causal: bool = True,
        norm_eps: float = 1e-6,
        init_std: float = 0.02,
        mlp: str = "silu",
        ffn_hidden: int = 0,
    ):
        super().__init__()
        if mlp not in MLPS:
            raise ValueError(f"mlp={mlp!r}: one of {', '.join(MLPS)}")
        # 0: dim * ffn_mult, the seed's 4 x dim (a SwiGLU MLP of that width has 1.5x the parameters;
        # LLaMA keeps the count by using 8/3 x dim: set ffn_hidden for that)
        ffn_hidden = ffn_hidden or dim * ffn_mult
        self.n_layers, self.n_heads, self.dim = n_layers, n_heads, dim
        self.init_std = init_std
        self._block_args = (dim, n_heads, ffn_hidden, causal, norm_eps, mlp)
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(TransformerBlock(*self._block_args) for _ in range(n_layers))
        self.head = nn.Linear(dim, vocab_size, bias=False)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); or, given targets and a head with a fused `loss` (the fused linear
        + cross-entropy of kernels/triton), the mean loss without ever forming the logits. The
        loss stays inside forward so FSDP2's root hooks cover the head weight it reads."""
        x = self.embed(idx)  # (B, T, C)
        for layer in self.layers:
            x = layer(x)
        return logits_or_loss(self.head, x, targets)

    def param_init(self, name: str) -> tuple[str, float]:
        """How parameter `name` is initialised: ("ones" | "zeros" | "normal", std).

        GPT-2's scheme: N(0, 0.02) for weights, with the two projections that write into the
        residual stream scaled by 1/sqrt(2 * n_layers) so its variance stays put with depth.
        Kept as data, not applied here, so sharded code can draw each full tensor from its own
        seeded generator and initial weights do not depend on the world size.
        """
        return gpt2_init(name, self.init_std, self.n_layers)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        """torchtitan's count (src/models/protocol.py): 6 x the non-embedding parameters (the untied
        head among them) plus 12 x layers x heads x head_dim x seq_len for attention."""
        return 6 * self.num_params(non_embedding=True) + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        return 12 * self.n_layers * self.n_heads * (self.dim // self.n_heads) * seq_len

    def new_block(self) -> nn.Module:
        return TransformerBlock(*self._block_args)

    def tie_weights(self) -> None:
        """Nothing is tied: the seed's head has its own weight."""
