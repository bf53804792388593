"""Qwen3's model.* settings: the LLaMA 3 family's (no rotary scaling), and how a Hugging Face
Qwen3ForCausalLM config.json gives them."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from src.models.config import HFConfigError
from src.models.llama3.config import Llama3Config, shape_fields


@dataclass
class Qwen3Config(Llama3Config):
    """Qwen3 (dense): LLaMA's block with q and k RMS-normed per head before RoPE."""

    arch: str = "qwen3"
    rope_theta: float = 1000000.0

    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ("Qwen3ForCausalLM",)
    GGUF_ARCHS: ClassVar[dict[str, str]] = {"Qwen3ForCausalLM": "qwen3"}

    @classmethod
    def from_hf(cls, config: dict) -> dict:
        if config.get("use_sliding_window") or any(t != "full_attention" for t in config.get("layer_types") or []):
            raise HFConfigError("use_sliding_window=true: sliding-window attention layers are not read; give a checkpoint of full attention")
        return {**shape_fields(config), "qkv_bias": bool(config.get("attention_bias", False))}


CONFIG = Qwen3Config
