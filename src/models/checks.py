"""A model config that composes but cannot be built: one line naming the value and the fix, before any
rank starts (train/checks.py and edge/checks.py call it). What every architecture shares is checked
here; each architecture's own checks live in its folder (src/models/ARCH/checks.py)."""
from __future__ import annotations

from dataclasses import fields

from omegaconf import DictConfig


def _schema_defaults() -> dict:
    from src.config import ModelConfig

    return {f.name: f.default for f in fields(ModelConfig)}


def model_refusal(m: DictConfig) -> str | None:
    """Why model.* cannot make a model, in one line; None where it can."""
    from src.models import ARCHS, foreign_fields

    if min(m.dim, m.n_layers, m.n_heads, m.vocab_size, m.ffn_mult) < 1 or min(m.ffn_hidden, m.n_kv_heads, m.head_dim) < 0:
        return ("model.dim, n_layers, n_heads, vocab_size and ffn_mult must all be positive (ffn_hidden, n_kv_heads and head_dim "
                f"0 or more); got dim={m.dim} n_layers={m.n_layers} n_heads={m.n_heads} vocab_size={m.vocab_size} ffn_mult={m.ffn_mult}")
    foreign = foreign_fields(m, _schema_defaults())
    if foreign:
        return (f"model.{foreign[0]}={m[foreign[0]]} is not a setting of model.arch={m.arch} (model={m.name}); "
                f"drop it, or use a model of the llama3 family (model=llama3_tiny, llama3_1b, ...)")
    if m.mlp not in ("silu", "swiglu"):
        return f"model.mlp={m.mlp}: use silu (the seed's MLP) or swiglu (LLaMA's gated MLP)"
    return ARCHS[str(m.arch)].refusal(m)
