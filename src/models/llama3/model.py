"""The LLaMA 3 family as a plain nn.Module (LLaMA 3.x, and shapes such as Qwen 2.5's): RoPE with LLaMA
3.1's scaling, grouped-query attention, a SwiGLU MLP, RMSNorm before each sub-layer and before the
head, an output head that may share the embedding's weight.

Pre-norm blocks, as MiniLLM's: x + Attn(RMSNorm(x)), then x + MLP(RMSNorm(x)), with the same module
names (norm1, attn, norm2, ffn) so the fused norms, SwiGLU and float8 swaps find them. Attention
projects q, k and v with one Linear of width (n_heads + 2 * n_kv_heads) * head_dim (one GEMM where
three would do the same work) and splits it; src/models/llama3/hf.py maps it to Hugging Face's
q_proj, k_proj and v_proj.
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.models.layers import PreNormBlock, SwiGLUFeedForward, gpt2_init, logits_or_loss
from src.models.llama3.rope import RopeConfig, apply_rotary, rotary_at, rotary_table


def llama_ffn_hidden(dim: int, multiple_of: int = 256) -> int:
    """LLaMA's MLP width when none is given: 8/3 x dim (SwiGLU's three matrices hold what a 4x
    two-matrix MLP holds), rounded up to a multiple of `multiple_of`."""
    return multiple_of * math.ceil(8 * dim / 3 / multiple_of)


class GroupedQueryAttention(nn.Module):
    """n_heads query heads sharing n_kv_heads key/value heads (n_kv_heads == n_heads: plain multi-head)."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rope: RopeConfig, qkv_bias: bool = False,
                 causal: bool = True):
        super().__init__()
        if n_heads % n_kv_heads:
            raise ValueError(f"n_heads={n_heads} is not a multiple of n_kv_heads={n_kv_heads}")
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads, head_dim
        self.rope, self.causal = rope, causal
        self.sizes = (n_heads * head_dim, n_kv_heads * head_dim, n_kv_heads * head_dim)
        self.qkv = nn.Linear(dim, sum(self.sizes), bias=qkv_bias)
        self.out_proj = nn.Linear(n_heads * head_dim, dim, bias=False)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k and v (B, KV, T, hd) before the rotation (a subclass may norm them here)."""
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split(self.sizes, dim=-1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # (B, H, T, hd)
        k = k.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)  # (B, KV, T, hd)
        v = v.view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        return q, k, v

    def heads(self, x: torch.Tensor, positions: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q (B, H, T, hd), k and v (B, KV, T, hd), q and k rotated for `positions` (T,): what attention
        reads, and what a KV cache keeps (src/edge/model.py). `table`: rotary_at's float32 (cos, sin)
        for those positions, made once for all blocks (Llama3.rotary_table); None: made here."""
        q, k, v = self.project(x)
        cos, sin = table if table is not None else rotary_at(self.rope, positions, torch.float32)
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # as rotary_at rounds its float32 table to the compute dtype
        return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin), v

    def forward(self, x: torch.Tensor, table: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
        B, T, _ = x.shape
        q, k, v = self.heads(x, torch.arange(T, device=x.device), table)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal, enable_gqa=self.n_kv_heads != self.n_heads)
        y = y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim)  # (B, T, H * hd)
        return self.out_proj(y)


class Llama3Block(PreNormBlock):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_hidden: int, rope: RopeConfig,
                 norm_eps: float, qkv_bias: bool, causal: bool):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.attn = GroupedQueryAttention(dim, n_heads, n_kv_heads, head_dim, rope, qkv_bias, causal)
        self.norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn = SwiGLUFeedForward(dim, ffn_hidden)


class Llama3(nn.Module):
    block: type[nn.Module] = Llama3Block
    """the block class, built from _block_args (a family on this code swaps its own in)"""

    def __init__(
        self,
        vocab_size: int = 128256,
        dim: int = 2048,
        n_layers: int = 16,
        n_heads: int = 32,
        n_kv_heads: int = 0,
        head_dim: int = 0,
        ffn_hidden: int = 0,
        norm_eps: float = 1e-5,
        rope_theta: float = 500000.0,
        rope_factor: float = 0.0,
        rope_low_freq: float = 1.0,
        rope_high_freq: float = 4.0,
        rope_original_len: int = 8192,
        tie_embeddings: bool = False,
        qkv_bias: bool = False,
        causal: bool = True,
        init_std: float = 0.02,
        mlp: str = "swiglu",
    ):
        super().__init__()
        if mlp != "swiglu":
            raise ValueError(f"mlp={mlp!r}: the LLaMA 3 family's MLP is swiglu")
        n_kv_heads = n_kv_heads or n_heads
        if not head_dim and dim % n_heads:
            raise ValueError(f"dim={dim} is not divisible by n_heads={n_heads}; give head_dim")
        head_dim = head_dim or dim // n_heads
        ffn_hidden = ffn_hidden or llama_ffn_hidden(dim)
        rope = RopeConfig(head_dim, rope_theta, rope_factor, rope_low_freq, rope_high_freq, rope_original_len)
        self.rope = rope
        self._rotary_tables: dict[tuple[int, torch.device], tuple[torch.Tensor, torch.Tensor]] = {}
        self.n_layers, self.n_heads, self.n_kv_heads, self.head_dim, self.dim = n_layers, n_heads, n_kv_heads, head_dim, dim
        self.tie_embeddings, self.init_std = tie_embeddings, init_std
        self._block_args = (dim, n_heads, n_kv_heads, head_dim, ffn_hidden, rope, norm_eps, qkv_bias, causal)
        self.embed = nn.Embedding(vocab_size, dim)
        self.layers = nn.ModuleList(self.block(*self._block_args) for _ in range(n_layers))
        self.norm = nn.RMSNorm(dim, eps=norm_eps)
        self.head = nn.Linear(dim, vocab_size, bias=False)
        self.tie_weights()

    def tie_weights(self) -> None:
        """The head's weight is the embedding's (one Parameter, which FSDP2 keeps in the root's unit);
        again after `to_empty`, which gives each module a tensor of its own."""
        if self.tie_embeddings and self.head.weight is not self.embed.weight:
            self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None) -> torch.Tensor:
        """Logits (B, T, vocab); or, given targets and a head with a fused `loss` (the fused linear
        + cross-entropy), the mean loss without forming the logits."""
        x = self.embed(idx)  # (B, T, dim)
        table = self.rotary_table(idx.shape[1], x.device)
        for layer in self.layers:
            x = layer(x, table)
        return logits_or_loss(self.head, self.norm(x), targets)

    def rotary_table(self, seq_len: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """The float32 (cos, sin) of positions 0 .. seq_len - 1, made once and handed to every block.
        Made inside each compiled block, Inductor fused the table's pow, cos and sin into the
        elementwise kernels over q and k and computed them again for every element of every head:
        in backward alone about ten times what the rotation's own bytes cost. Kept per (seq_len,
        device) between steps; not a buffer,
        so a model built on meta and materialised by to_empty has nothing to fill."""
        if torch.compiler.is_compiling():
            return rotary_table(self.rope, seq_len, device, torch.float32)
        key = (seq_len, device)
        if key not in self._rotary_tables:
            self._rotary_tables[key] = rotary_table(self.rope, seq_len, device, torch.float32)
        return self._rotary_tables[key]

    def param_init(self, name: str) -> tuple[str, float]:
        """GPT-2's scheme, as MiniLLM's: N(0, init_std), the projections that write into the residual
        stream scaled by 1/sqrt(2 * n_layers), norms ones, biases zeros (a tied head is the embedding)."""
        return gpt2_init(name, self.init_std, self.n_layers)

    def num_params(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())  # a tied weight once
        return n - self.embed.weight.numel() if non_embedding else n

    def flops_per_token(self, seq_len: int) -> float:
        matmul = self.num_params(non_embedding=True) + (self.embed.weight.numel() if self.tie_embeddings else 0)
        return 6 * matmul + self.attention_flops_per_token(seq_len)

    def attention_flops_per_token(self, seq_len: int) -> float:
        return 12 * self.n_layers * self.n_heads * self.head_dim * seq_len

    def new_block(self) -> nn.Module:
        return self.block(*self._block_args)
