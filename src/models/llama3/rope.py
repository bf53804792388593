"""Rotary position embeddings as LLaMA 3 uses them: the rotate-half form of Hugging Face's
LlamaForCausalLM (so its checkpoints load with no permutation of q and k), and LLaMA 3.1's frequency
scaling, which stretches the long wavelengths by `factor` and leaves the short ones, blending between.

Computed in float32 from the positions, and never a buffer (one made on the meta device would hold
garbage after FSDP2's `to_empty`): the model makes the table once and hands it to its blocks
(src/models/llama3/model.py Llama3.rotary_table).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class RopeConfig:
    head_dim: int
    theta: float = 500000.0
    factor: float = 0.0
    """LLaMA 3.1's scaling factor (8 for 3.1-8B, 32 for 3.2-1B and 3B); 0: no scaling"""
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_len: int = 8192
    """the context length the unscaled frequencies were trained at"""


def inverse_frequencies(rope: RopeConfig, device: torch.device | None = None) -> torch.Tensor:
    """(head_dim // 2,) float32: theta ** (-2i / head_dim), scaled as LLaMA 3.1 does where `factor` is set."""
    dim = rope.head_dim
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.int64, device=device).float() / dim))
    if not rope.factor:
        return inv_freq
    low_wavelen = rope.original_len / rope.low_freq_factor
    high_wavelen = rope.original_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / rope.factor, inv_freq)  # long wavelengths: stretched
    smooth = (rope.original_len / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - smooth) * scaled / rope.factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(medium, blended, scaled)


def rotary_at(rope: RopeConfig, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (len(positions), head_dim) in `dtype`, for the given positions (an int tensor:
    a KV cache's decode passes the one it writes): position p's angles p * inv_freq, twice over."""
    inv_freq = inverse_frequencies(rope, positions.device)
    angles = torch.outer(positions.to(torch.float32), inv_freq)  # (T, hd/2)
    emb = torch.cat((angles, angles), dim=-1)  # (T, hd)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rotary_table(rope: RopeConfig, seq_len: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rotary_at positions 0 .. seq_len - 1."""
    return rotary_at(rope, torch.arange(seq_len, device=device), dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x (B, heads, T, hd) rotated by the table (T, hd)."""
    return x * cos + rotate_half(x) * sin
