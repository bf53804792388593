"""model.* settings MiniLLM cannot be built with (src/models/checks.py runs the ones every architecture shares first)."""
from __future__ import annotations

from omegaconf import DictConfig


def refusal(m: DictConfig) -> str | None:
    if m.ffn_mult < 1:
        return f"model.ffn_mult={m.ffn_mult}: the MLP's hidden width is dim x ffn_mult, so it must be 1 or more"
    if m.dim % m.n_heads:
        return f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; pick a dim that is a multiple of {m.n_heads}, or another n_heads"
    return None
