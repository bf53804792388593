"""The LLaMA 3 family (model.py), its rotary embeddings (rope.py) and Hugging Face checkpoints (hf.py)."""
from src.models.llama3.model import GroupedQueryAttention, Llama3, Llama3Block, llama_ffn_hidden

__all__ = ["GroupedQueryAttention", "Llama3", "Llama3Block", "llama_ffn_hidden"]
