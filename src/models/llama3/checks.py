"""model.* settings the LLaMA 3 family cannot be built with (src/models/checks.py runs the checks every
architecture shares first, and model.hf_path's after these)."""
from __future__ import annotations

from omegaconf import DictConfig


def refusal(m: DictConfig) -> str | None:
    if m.mlp != "swiglu":
        return f"model.mlp={m.mlp}: the LLaMA 3 family's MLP is swiglu (model.arch={m.arch})"
    if not m.head_dim and m.dim % m.n_heads:
        return f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; pick another n_heads, or set model.head_dim"
    kv = m.n_kv_heads or m.n_heads
    if m.n_heads % kv:
        return f"model.n_kv_heads={kv} does not divide model.n_heads={m.n_heads}: grouped-query attention shares each key/value head among n_heads / n_kv_heads query heads"
    head_dim = m.head_dim or m.dim // m.n_heads
    if head_dim % 2:
        return f"model.head_dim={head_dim}: rotary embeddings rotate pairs of a head's dimensions, so it must be even"
    if not m.rope_theta > 0:
        return f"model.rope_theta={m.rope_theta}: the rotary embedding's base must be above 0 (LLaMA 3: 500000, Qwen 2.5: 1000000)"
    if m.rope_factor and not m.rope_high_freq > m.rope_low_freq > 0:
        return f"model.rope_high_freq={m.rope_high_freq} must be above model.rope_low_freq={m.rope_low_freq} > 0 (LLaMA 3.1's scaling: 4 and 1)"
    return None
