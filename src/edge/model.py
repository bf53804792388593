"""A model of src/models/ for inference on edge runtimes: prefill and greedy decode over a KV cache
that lives in the model, so a compiled module keeps it on the device.

The same parameters as the trained model (it wraps its modules, so a checkpoint or a safetensors
export loads unchanged), reading it through src/models/protocol.py: each block's `attn.heads(x,
positions)` gives q, k and v as the cache keeps them (LLaMA's rotated for their positions, its keys
and values for its n_kv_heads only, shared by the query heads' groups), `norm` (where the model has
one) comes before the head. With what ahead-of-time compilers need:

- Attention written as matmul -> masked softmax -> matmul. IREE 3.13 fails to compile its fused
  attention op for SPIR-V (`iree_linalg_ext.online_attention` bufferization), which is what
  `scaled_dot_product_attention` lowers to; the explicit form compiles for every target.
- The cache is two persistent buffers, `k_cache` and `v_cache`, (L, B, kv heads, max_seq, head_dim)
  each. iree.turbine exports a mutated buffer as a mutable module global, and an externalised one
  as a parameter (zeros in the .irpa) rather than constants in the .vmfb: inlined zeros made a
  16 MiB module for a 16 MiB cache. So no cache tensor crosses the module boundary: a decode call
  takes one token per sequence and a position, and writes that position of every layer with one
  `index_copy_` (a scatter into the global, done in place by IREE). Attention reads the position
  being written through a one-hot select, so each layer needs only the old cache.
- RMSNorm squares and sums in fp32 whatever the weights' dtype (FP32RMSNorm), as torch's own
  kernels and Hugging Face's LLaMA do: torch-mlir lowers `rms_norm` in its input's dtype, and a
  trained model's residual rows have sums of squares past fp16's largest value, which overflow to
  inf and zero the normed row (and every logit after it).
- Greedy sampling inside the module (`greedy_token`): each call returns the argmax token (int32, one per sequence)
  for the host to read, and the logits as a device buffer the host reads only to check them.
  `decode_token` returns the token alone: its logits stay a transient of the call, so a timed step
  allocates no [B, vocab] result (125 KiB at vocab 32000, batch 1, fp32) that nobody reads.

prefill(tokens[B, T] int32) -> (next token [B] int32, logits of the last position [B, V])
prefill_token_into(tokens[B, T] int32, out[B] int32) -> tokens, the next token written into out
decode(token[B] int32, pos[1] int32) -> (next token [B] int32, logits [B, V])
decode_token(token[B] int32, pos[1] int32) -> next token [B] int32 (decode's cache update, no logits out)
decode_token_into(token[B] int32, pos[1] int32, out[B] int32) -> pos, the token written into out
kv_cache(unused[1]) -> (k_cache, v_cache), for tests and checks
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.models.layers import add_norm


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(d) + mask) v for (B, nh, Tq, hs) queries over (B, kv, S, hs) keys (kv heads,
    each shared by nh / kv query heads: repeated up to nh)."""
    if k.shape[1] != q.shape[1]:
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * (1.0 / math.sqrt(q.shape[-1]))
    # softmax in fp32: fp16 scores of a 256-wide row would round the normaliser to 11 bits
    probs = torch.softmax((scores + mask).float(), dim=-1).to(v.dtype)
    return torch.matmul(probs, v)


class FP32RMSNorm(nn.RMSNorm):
    """nn.RMSNorm computed in fp32 and returned in the input's dtype; the same parameters."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weight = None if self.weight is None else self.weight.float()
        return F.rms_norm(x.float(), self.normalized_shape, weight, self.eps).to(x.dtype)


GREEDY_CHUNK = 128


def greedy_token(logits: torch.Tensor) -> torch.Tensor:
    """argmax over the last dim (the first index of the largest logit, as torch.argmax), int32.

    In two stages: the argmax of each chunk of 128 logits, then the argmax of the chunks' maxima.
    IREE runs an argmax row (`arg_compare`) serially, one element after another: over a vocabulary's
    logits that was most of the GPU time of a `model=small` fp16 decode step
    (`benchmarks.edge_dispatches` measures it); here the chunks run side by side, then one row of
    their maxima. (A
    max, then the lowest index holding it, does not compile for SPIR-V in IREE 3.13: the pattern
    becomes an index reduction whose workgroup scratch is an `index` array.) Ties go to the first
    index in both stages, so to the first overall, as torch.argmax's."""
    vocab = logits.shape[-1]
    chunks = -(-vocab // GREEDY_CHUNK)
    if chunks * GREEDY_CHUNK != vocab:  # padding never wins: -inf is below every logit
        logits = torch.nn.functional.pad(logits, (0, chunks * GREEDY_CHUNK - vocab), value=float("-inf"))
    best, within = logits.reshape(*logits.shape[:-1], chunks, GREEDY_CHUNK).max(dim=-1)
    chunk = best.argmax(dim=-1, keepdim=True)
    return (chunk.squeeze(-1) * GREEDY_CHUNK + within.gather(-1, chunk).squeeze(-1)).to(torch.int32)


class EdgeLM(nn.Module):
    def __init__(self, model: nn.Module, max_seq: int, batch: int = 1):
        super().__init__()
        for norm in model.modules():
            if type(norm) is nn.RMSNorm:
                norm.__class__ = FP32RMSNorm  # in place: the parameters and their names stay
        self.model = model
        self.max_seq = max_seq
        attn = model.layers[0].attn
        self.n_heads, self.n_kv_heads, self.head_dim = attn.n_heads, attn.n_kv_heads, attn.head_dim
        self.resize_cache(batch)

    def resize_cache(self, batch: int) -> EdgeLM:
        """Zeroed caches for `batch` sequences, in the dtype and on the device of the weights."""
        w = self.model.embed.weight
        shape = (len(self.model.layers), batch, self.n_kv_heads, self.max_seq, self.head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=w.dtype, device=w.device))
        self.register_buffer("v_cache", torch.zeros(shape, dtype=w.dtype, device=w.device))
        return self

    @property
    def batch(self) -> int:
        return self.k_cache.shape[1]

    def _qkv(self, block: nn.Module, x: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        return block.attn.heads(block.norm1(x), positions)  # q (B, nh, T, hs); k, v (B, kv, T, hs)

    def _finish(self, block: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = y.shape
        y = block.attn.out_proj(y.transpose(1, 2).reshape(B, T, -1))
        h, normed = add_norm(block.norm2, x, y)
        return h + block.ffn(normed)

    def _sample(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = x[:, -1]
        norm = getattr(self.model, "norm", None)  # LLaMA's norm before the head; MiniLLM has none
        logits = self.model.head(norm(x) if norm is not None else x)  # (B, V)
        return greedy_token(logits), logits

    def prefill(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        B, T = tokens.shape
        x = self.model.embed(tokens)
        causal = torch.full((T, T), float("-inf"), dtype=x.dtype, device=x.device).triu(1)
        positions = torch.arange(T, device=x.device)
        ks, vs = [], []
        for block in self.model.layers:
            q, k, v = self._qkv(block, x, positions)
            ks.append(k)
            vs.append(v)
            x = self._finish(block, x, _attend(q, k, v, causal))
        # positions T.. keep what an earlier generation left: decode masks every position past its
        # own and writes each before reading it. (A whole-cache copy_ would also never read the
        # buffer, and iree.turbine cannot store to a global that no program has loaded.)
        self.k_cache[:, :, :, :T] = torch.stack(ks)
        self.v_cache[:, :, :, :T] = torch.stack(vs)
        return self._sample(x)

    def decode(self, token: torch.Tensor, pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.model.embed(token.view(-1, 1))  # (B, 1, C)
        positions = torch.arange(self.max_seq, device=x.device)
        here = (positions == pos).view(1, 1, self.max_seq, 1)  # the slot this token writes
        mask = torch.where(positions <= pos, 0.0, float("-inf")).to(x.dtype).view(1, 1, 1, self.max_seq)
        ks, vs = [], []
        for i, block in enumerate(self.model.layers):
            q, k, v = self._qkv(block, x, pos)  # q (B, nh, 1, hs), k and v (B, kv, 1, hs)
            ks.append(k)
            vs.append(v)
            x = self._finish(block, x, _attend(q, torch.where(here, k, self.k_cache[i]), torch.where(here, v, self.v_cache[i]), mask))
        index = pos.to(torch.int64)
        self.k_cache.index_copy_(3, index, torch.stack(ks))  # (L, B, kv, 1, hs) into position pos
        self.v_cache.index_copy_(3, index, torch.stack(vs))
        return self._sample(x)

    def prefill_token_into(self, tokens: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """prefill's cache writes and next token, the token written into `out` (the caller's buffer, as
        decode_token_into): no [B, vocab] logits result is allocated and no token result either.
        Returns `tokens` (a program must return something)."""
        out.copy_(self.prefill(tokens)[0])
        return tokens

    def decode_token(self, token: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        return self.decode(token, pos)[0]

    def decode_token_into(self, token: torch.Tensor, pos: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        """decode_token written into `out`, a buffer the caller owns. Exported, the mutated argument
        becomes an alias of the caller's buffer (hal.tensor.alias): the call allocates no result,
        and a caller that gives host-visible memory reads the token there, no copy. Returns `pos`
        (a program must return something, and returning `out` would allocate a result again)."""
        out.copy_(self.decode_token(token, pos))
        return pos
