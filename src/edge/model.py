"""MiniLLM for inference on edge runtimes: prefill and decode over a static-size KV cache.

The same parameters as src/models/mini_llm.py (it wraps the trained modules, so a checkpoint or a
safetensors export loads unchanged), with what ahead-of-time compilers need:

- Attention written as matmul -> masked softmax -> matmul. IREE 3.13 fails to compile its fused
  attention op for SPIR-V (`iree_linalg_ext.online_attention` bufferization), which is what
  `scaled_dot_product_attention` lowers to; the explicit form compiles for every target.
- Static shapes: the cache holds `max_seq` positions for every layer, (L, B, heads, max_seq,
  head_dim) for keys and for values, passed in and returned by each call, so one compiled module
  serves every step. Decode writes position `pos` with a one-hot select instead of an indexed
  store (a dynamic scatter costs more than the select on these sizes and some SPIR-V targets
  lack it) and masks the positions past `pos`.

prefill(tokens[B, T]) -> (logits of the last position [B, V], k_cache, v_cache)
decode(token[B, 1], pos[1] int64, k_cache, v_cache) -> (logits [B, V], k_cache, v_cache)
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.models.mini_llm import MiniLLM, add_norm


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for (B, nh, Tq, hs) queries over (B, nh, S, hs) keys."""
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    # softmax in fp32: fp16 scores of a 256-wide row would round the normaliser to 11 bits
    probs = torch.softmax((scores + mask).float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class EdgeLM(nn.Module):
    def __init__(self, model: MiniLLM, max_seq: int):
        super().__init__()
        self.model = model
        self.max_seq = max_seq
        self.n_heads = model.n_heads
        self.head_dim = model.dim // model.n_heads

    def empty_cache(self, batch: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.zeros(len(self.model.layers), batch, self.n_heads, self.max_seq, self.head_dim, dtype=dtype, device=device)

    def _qkv(self, block: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T, C = x.shape
        qkv = block.attn.in_proj(block.norm1(x)).view(B, T, 3, self.n_heads, self.head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each (B, nh, T, hs)
        return q, k, v

    def _finish(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        y = block.attn.out_proj(y.transpose(1, 2).reshape(B, T, -1))
        h, normed = add_norm(block.norm2, x, y)
        return h + block.ffn(normed)

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        B, T = tokens.shape
        x = self.model.embed(tokens)
        causal = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        pad = (0, 0, 0, self.max_seq - T)  # (hs left/right, positions left/right)
        ks, vs = [], []
        for block in self.model.layers:
            q, k, v = self._qkv(block, x)
            ks.append(F.pad(k, pad))
            vs.append(F.pad(v, pad))
            x = self._finish(block, x, _attend(q, k, v, causal))
        return self.model.head(x[:, -1]), torch.stack(ks), torch.stack(vs)

    def decode(self, token: torch.Tensor, pos: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x = self.model.embed(token)  # (B, 1, C)
        positions = torch.arange(self.max_seq, device=x.device)
        here = (positions == pos).view(1, 1, self.max_seq, 1)  # the slot this token writes
        mask = torch.where(positions <= pos, 0.0, float("-inf")).to(x.dtype).view(1, 1, 1, self.max_seq)
        ks, vs = [], []
        for i, block in enumerate(self.model.layers):
            q, k, v = self._qkv(block, x)  # (B, nh, 1, hs)
            k_all = torch.where(here, k, k_cache[i])
            v_all = torch.where(here, v, v_cache[i])
            ks.append(k_all)
            vs.append(v_all)
            x = self._finish(block, x, _attend(q, k_all, v_all, mask))
        return self.model.head(x[:, -1]), torch.stack(ks), torch.stack(vs)


def generate_greedy(lm: EdgeLM, tokens: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """Reference loop in torch: the prefill logits, then `steps` decode logits, feeding the argmax."""
    logits, kc, vc = lm.prefill(tokens)
    out = [logits]
    for i in range(steps):
        nxt = logits.argmax(-1, keepdim=True)
        logits, kc, vc = lm.decode(nxt, torch.tensor([tokens.shape[1] + i]), kc, vc)
        out.append(logits)
    return out
