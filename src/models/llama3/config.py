"""The LLaMA 3 family's model.* settings, and how a Hugging Face config.json of LlamaForCausalLM or
Qwen2ForCausalLM (LLaMA's layout with biases on q, k and v) gives them (from_hf)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from src.models.config import HFConfigError, Mlp, ModelConfig


@dataclass
class Llama3Config(ModelConfig):
    """LLaMA 3.x (and Qwen 2.5's shapes): RoPE with 3.1's scaling, grouped-query attention, SwiGLU."""

    arch: str = "llama3"
    mlp: Mlp = Mlp.swiglu
    n_kv_heads: int = 0
    """key/value heads that the query heads share in groups (grouped-query attention); 0: n_heads"""
    head_dim: int = 0
    """width of a head; 0: dim / n_heads"""
    rope_theta: float = 500000.0
    """the rotary embedding's base"""
    rope_factor: float = 0.0
    """LLaMA 3.1's rotary frequency scaling (8 for 3.1-8B, 32 for 3.2-1B/3B); 0: none"""
    rope_low_freq: float = 1.0
    """LLaMA 3.1 scaling's low_freq_factor"""
    rope_high_freq: float = 4.0
    """LLaMA 3.1 scaling's high_freq_factor"""
    rope_original_len: int = 8192
    """the context length the unscaled frequencies were trained at"""
    tie_embeddings: bool = False
    """the output head shares the token embedding's weight"""
    qkv_bias: bool = False
    """biases on the q, k and v projections (Qwen 2.5)"""

    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("LlamaForCausalLM", "Qwen2ForCausalLM")
    GGUF_ARCHS: ClassVar[dict[str, str]] = {"LlamaForCausalLM": "llama", "Qwen2ForCausalLM": "qwen2"}

    @classmethod
    def from_hf(cls, config: dict) -> dict:
        arch = (config.get("architectures") or ["?"])[0]
        if arch == "LlamaForCausalLM" and (config.get("attention_bias") or config.get("mlp_bias")):
            raise HFConfigError("attention_bias/mlp_bias=true: a LLaMA with biases is not read (Qwen2ForCausalLM's q, k, v biases are)")
        return {**shape_fields(config), "qkv_bias": arch == "Qwen2ForCausalLM"}


def shape_fields(config: dict) -> dict:
    """The fields every LLaMA-like config.json gives: widths, heads, norm, RoPE and the tied head."""
    arch = (config.get("architectures") or ["?"])[0]
    needed = ("num_attention_heads", "vocab_size", "hidden_size", "num_hidden_layers", "intermediate_size")
    missing = [k for k in needed if not isinstance(config.get(k), int)]
    if missing:
        raise HFConfigError(f"config.json has no whole number {missing[0]}: not a {arch} config")
    n_heads = config["num_attention_heads"]
    theta, scaling = _rope(config)
    fields = {
        "vocab_size": config["vocab_size"], "dim": config["hidden_size"], "n_layers": config["num_hidden_layers"],
        "n_heads": n_heads, "n_kv_heads": config.get("num_key_value_heads") or n_heads,
        "head_dim": config.get("head_dim") or config["hidden_size"] // n_heads, "ffn_hidden": config["intermediate_size"],
        "norm_eps": float(config.get("rms_norm_eps", 1e-6)), "rope_theta": theta, "rope_factor": float(scaling.get("factor", 0.0)),
        "tie_embeddings": bool(config.get("tie_word_embeddings", False)),
    }
    if config.get("hidden_act", "silu") != "silu":
        raise HFConfigError(f"hidden_act={config['hidden_act']}: the family's MLP is SwiGLU (silu)")
    if scaling:
        fields.update(rope_low_freq=float(scaling["low_freq_factor"]), rope_high_freq=float(scaling["high_freq_factor"]),
                      rope_original_len=int(scaling["original_max_position_embeddings"]))
    return fields


def _rope(config: dict) -> tuple[float, dict]:
    """(theta, the llama3 scaling dict or {}) from either transformers 4's or 5's way of writing them."""
    params = config.get("rope_parameters") or {}
    scaling = config.get("rope_scaling") or {}
    theta = float(params.get("rope_theta", config.get("rope_theta", 10000.0)))
    kind = params.get("rope_type") or scaling.get("rope_type") or scaling.get("type")
    if kind in (None, "default"):
        return theta, {}
    if kind != "llama3":
        raise HFConfigError(f"rope type {kind!r}: only LLaMA 3.1's scaling (llama3) or none is read")
    source = params if params.get("rope_type") == "llama3" else scaling
    return theta, source


CONFIG = Llama3Config
