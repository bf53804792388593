"""A model config that composes but cannot be built: one line naming the value and the fix, before any
rank starts (train/checks.py and edge/checks.py call it)."""
from __future__ import annotations

from dataclasses import fields
from pathlib import Path

from omegaconf import DictConfig


def _schema_defaults() -> dict:
    from src.config import ModelConfig

    return {f.name: f.default for f in fields(ModelConfig)}


def model_refusal(m: DictConfig) -> str | None:
    """Why model.* cannot make a model, in one line; None where it can."""
    from src.models import foreign_fields

    if min(m.dim, m.n_layers, m.n_heads, m.vocab_size, m.ffn_mult) < 1 or min(m.ffn_hidden, m.n_kv_heads, m.head_dim) < 0:
        return ("model.dim, n_layers, n_heads, vocab_size and ffn_mult must all be positive (ffn_hidden, n_kv_heads and head_dim "
                f"0 or more); got dim={m.dim} n_layers={m.n_layers} n_heads={m.n_heads} vocab_size={m.vocab_size} ffn_mult={m.ffn_mult}")
    foreign = foreign_fields(m, _schema_defaults())
    if foreign:
        return (f"model.{foreign[0]}={m[foreign[0]]} is not a setting of model.arch={m.arch} (model={m.name}); "
                f"drop it, or use a model of the llama3 family (model=llama3_tiny, llama3_1b, ...)")
    if m.mlp not in ("silu", "swiglu"):
        return f"model.mlp={m.mlp}: use silu (the seed's MLP) or swiglu (LLaMA's gated MLP)"
    if m.arch == "mini_llm":
        if m.dim % m.n_heads:
            return f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; pick a dim that is a multiple of {m.n_heads}, or another n_heads"
        return None
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
    if m.rope_factor and not m.rope_high_freq > m.rope_low_freq > 0:
        return f"model.rope_high_freq={m.rope_high_freq} must be above model.rope_low_freq={m.rope_low_freq} > 0 (LLaMA 3.1's scaling: 4 and 1)"
    if m.hf_path:
        return hf_refusal(m)
    return None


def hf_refusal(m: DictConfig) -> str | None:
    """model.hf_path: a Hugging Face folder whose shape is this model's."""
    from src.models.llama3.hf import HFCheckpointError, shape_mismatch

    folder = Path(m.hf_path)
    if not folder.is_dir():
        return f"model.hf_path={m.hf_path}: no such folder; give a Hugging Face LlamaForCausalLM folder (config.json, model.safetensors)"
    try:
        return shape_mismatch(m, folder)
    except HFCheckpointError as err:
        return str(err)
