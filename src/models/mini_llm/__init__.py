"""docs/SEED.md's MiniLLM (model.py)."""
from src.models.mini_llm.model import (
    MLPS,
    Attention,
    FeedForward,
    MiniLLM,
    SiLUMul,
    SwiGLUFeedForward,
    TransformerBlock,
    add_norm,
    split_projection,
)

__all__ = ["MLPS", "Attention", "FeedForward", "MiniLLM", "SiLUMul", "SwiGLUFeedForward", "TransformerBlock", "add_norm", "split_projection"]
