"""Hugging Face Qwen3ForCausalLM folders, in and out: LLaMA's names (src/models/llama3/hf.py) and
each block's self_attn.q_norm and k_norm."""
from __future__ import annotations

import torch

from src.models.llama3.hf import BLOCK_NAMES, LlamaHF
from src.models.qwen3.config import Qwen3Config


class Qwen3HF(LlamaHF):
    schema = Qwen3Config
    block_names = {**BLOCK_NAMES, "attn.q_norm.weight": "self_attn.q_norm.weight", "attn.k_norm.weight": "self_attn.k_norm.weight"}

    def expected_shapes(self, fields: dict) -> dict[str, tuple[int, ...]]:
        shapes = super().expected_shapes(fields)
        for i in range(fields["n_layers"]):
            shapes.update({f"model.layers.{i}.self_attn.q_norm.weight": (fields["head_dim"],),
                           f"model.layers.{i}.self_attn.k_norm.weight": (fields["head_dim"],)})
        return shapes

    def config_for(self, model: torch.nn.Module, model_cfg: dict, dtype: torch.dtype) -> dict:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **self.shape_config(model, model_cfg, dtype),
                "attention_bias": bool(model_cfg.get("qkv_bias")), "use_sliding_window": False}


HF = Qwen3HF()
