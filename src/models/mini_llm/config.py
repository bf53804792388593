"""MiniLLM's model.* settings (conf/model/tiny.yaml, small.yaml, mini_llm.yaml pull them)."""
from __future__ import annotations

from dataclasses import dataclass

from src.models.config import ModelConfig


@dataclass
class MiniLLMConfig(ModelConfig):
    """docs/SEED.md's MiniLLM: one fused q/k/v projection, no positional encoding, an untied head."""

    arch: str = "mini_llm"
    ffn_mult: int = 4
    """hidden width of the MLP as a multiple of dim (the seed's 4), where ffn_hidden is 0"""


CONFIG = MiniLLMConfig
