"""Hugging Face checkpoints of the LLaMA 3 family, in and out: LlamaForCausalLM, and
Qwen2ForCausalLM (the same layout with biases on q, k and v). Reading, checking and writing by rows
are src/models/hf.py's; the names are here.

Our fused `attn.qkv` is Hugging Face's q_proj, k_proj and v_proj stacked by rows (in that order);
everything else maps one to one. Both use rotate-half RoPE, so no row of q or k is permuted.
"""
from __future__ import annotations

import torch

from src.models.hf import RowMappedHF, Segment
from src.models.llama3.config import Llama3Config

# our names inside a block -> Hugging Face's, one tensor each
BLOCK_NAMES = {"norm1.weight": "input_layernorm.weight", "norm2.weight": "post_attention_layernorm.weight",
               "attn.out_proj.weight": "self_attn.o_proj.weight", "ffn.gate.weight": "mlp.gate_proj.weight",
               "ffn.up.weight": "mlp.up_proj.weight", "ffn.down.weight": "mlp.down_proj.weight"}


class LlamaHF(RowMappedHF):
    schema = Llama3Config
    block_names = BLOCK_NAMES

    def expected_shapes(self, fields: dict) -> dict[str, tuple[int, ...]]:
        dim, hd, ffn = fields["dim"], fields["head_dim"], fields["ffn_hidden"]
        q, kv = fields["n_heads"] * hd, fields["n_kv_heads"] * hd
        shapes = {"model.embed_tokens.weight": (fields["vocab_size"], dim), "model.norm.weight": (dim,)}
        if not fields["tie_embeddings"]:
            shapes["lm_head.weight"] = (fields["vocab_size"], dim)
        for i in range(fields["n_layers"]):
            b = f"model.layers.{i}"
            shapes.update({f"{b}.input_layernorm.weight": (dim,), f"{b}.post_attention_layernorm.weight": (dim,),
                           f"{b}.self_attn.q_proj.weight": (q, dim), f"{b}.self_attn.k_proj.weight": (kv, dim),
                           f"{b}.self_attn.v_proj.weight": (kv, dim), f"{b}.self_attn.o_proj.weight": (dim, q),
                           f"{b}.mlp.gate_proj.weight": (ffn, dim), f"{b}.mlp.up_proj.weight": (ffn, dim), f"{b}.mlp.down_proj.weight": (dim, ffn)})
            if fields.get("qkv_bias"):
                shapes.update({f"{b}.self_attn.q_proj.bias": (q,), f"{b}.self_attn.k_proj.bias": (kv,), f"{b}.self_attn.v_proj.bias": (kv,)})
        return shapes

    def sources(self, name: str, model: torch.nn.Module) -> list[Segment]:
        if name == "embed.weight":
            return [Segment("model.embed_tokens.weight", 0, -1)]
        if name == "norm.weight":
            return [Segment("model.norm.weight", 0, -1)]
        if name == "head.weight":
            return [Segment("model.embed_tokens.weight" if model.tie_embeddings else "lm_head.weight", 0, -1)]
        parts = name.split(".")
        if parts[0] != "layers":
            raise KeyError(name)
        block, rest = f"model.layers.{parts[1]}", ".".join(parts[2:])
        if rest.startswith("attn.qkv."):
            kind = rest.rpartition(".")[2]  # weight or bias
            q, k, v = model.layers[0].attn.sizes
            return [Segment(f"{block}.self_attn.q_proj.{kind}", 0, q), Segment(f"{block}.self_attn.k_proj.{kind}", q, q + k),
                    Segment(f"{block}.self_attn.v_proj.{kind}", q + k, q + k + v)]
        return [Segment(f"{block}.{self.block_names[rest]}", 0, -1)]

    def config_for(self, model: torch.nn.Module, model_cfg: dict, dtype: torch.dtype) -> dict:
        """LlamaForCausalLM (Qwen2ForCausalLM where q, k and v have biases)."""
        qwen = bool(model_cfg.get("qkv_bias"))
        config = {
            "architectures": ["Qwen2ForCausalLM" if qwen else "LlamaForCausalLM"], "model_type": "qwen2" if qwen else "llama",
            **self.shape_config(model, model_cfg, dtype),
        }
        if not qwen:
            config.update(attention_bias=False, mlp_bias=False)
        return config

    def shape_config(self, model: torch.nn.Module, model_cfg: dict, dtype: torch.dtype) -> dict:
        """config.json's widths, heads, norm, RoPE and tied head, as every LLaMA-like family writes them."""
        config = {
            "vocab_size": model_cfg["vocab_size"], "hidden_size": model.dim, "num_hidden_layers": model.n_layers,
            "num_attention_heads": model.n_heads, "num_key_value_heads": model.n_kv_heads, "head_dim": model.head_dim,
            "intermediate_size": model.layers[0].ffn.gate.out_features, "rms_norm_eps": model_cfg["norm_eps"],
            "hidden_act": "silu", "tie_word_embeddings": bool(model.tie_embeddings), "max_position_embeddings": 131072,
            "torch_dtype": str(dtype).removeprefix("torch."), "rope_theta": model_cfg["rope_theta"],
        }
        if model_cfg.get("rope_factor"):
            config["rope_scaling"] = {"rope_type": "llama3", "factor": model_cfg["rope_factor"], "low_freq_factor": model_cfg["rope_low_freq"],
                                      "high_freq_factor": model_cfg["rope_high_freq"], "original_max_position_embeddings": model_cfg["rope_original_len"]}
        return config


HF = LlamaHF()
