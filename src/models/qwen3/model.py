"""Qwen3 as a plain nn.Module: the LLaMA 3 code (src/models/llama3/model.py) with a block whose
attention RMS-norms each head of q and k before the rotation, as Qwen3ForCausalLM does. Everything
that reads a block (FSDP2, float8, the fused norms, edge export) finds the same names; the two
norms are parameters of `attn` (q_norm, k_norm), over a head's width."""
from __future__ import annotations

import torch
import torch.nn as nn

from src.models.layers import PreNormBlock, SwiGLUFeedForward
from src.models.llama3.model import GroupedQueryAttention, Llama3
from src.models.llama3.rope import RopeConfig


class QKNormAttention(GroupedQueryAttention):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, rope: RopeConfig, norm_eps: float,
                 qkv_bias: bool = False, causal: bool = True):
        super().__init__(dim, n_heads, n_kv_heads, head_dim, rope, qkv_bias, causal)
        self.q_norm = nn.RMSNorm(head_dim, eps=norm_eps)
        self.k_norm = nn.RMSNorm(head_dim, eps=norm_eps)

    def project(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        q, k, v = super().project(x)
        return self.q_norm(q), self.k_norm(k), v


class Qwen3Block(PreNormBlock):
    def __init__(self, dim: int, n_heads: int, n_kv_heads: int, head_dim: int, ffn_hidden: int, rope: RopeConfig,
                 norm_eps: float, qkv_bias: bool, causal: bool):
        super().__init__()
        self.norm1 = nn.RMSNorm(dim, eps=norm_eps)
        self.attn = QKNormAttention(dim, n_heads, n_kv_heads, head_dim, rope, norm_eps, qkv_bias, causal)
        self.norm2 = nn.RMSNorm(dim, eps=norm_eps)
        self.ffn = SwiGLUFeedForward(dim, ffn_hidden)


class Qwen3(Llama3):
    block = Qwen3Block

    def param_init(self, name: str) -> tuple[str, float]:
        """LLaMA's, with the per-head norms at ones like every norm."""
        if name.endswith(("q_norm.weight", "k_norm.weight")):
            return "ones", 0.0
        return super().param_init(name)
