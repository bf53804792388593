"""transformers' own model classes (LlamaForCausalLM, Qwen2ForCausalLM, ... as config.json's `architectures`
names them), the reference the model families' tests compare with.

Run as a script in a process of its own, from outside the repository: transformers 5 imports
Hugging Face's `kernels` package, whose name this project's top-level `kernels/` would shadow on a
path that starts at the repository.

    python tests/support/hf_reference.py make FOLDER CONFIG_JSON SEED [MAX_SHARD]   a random checkpoint, saved
    python tests/support/hf_reference.py logits FOLDER TOKENS_PT OUT_PT             its fp32 logits for the tokens
"""
from __future__ import annotations

import json
import sys

import torch


def _classes(config: dict):
    """(config class, model class) of config.json's `architectures`, as transformers names them."""
    import transformers

    model_cls = getattr(transformers, config.get("architectures", ["LlamaForCausalLM"])[0])
    return model_cls.config_class, model_cls


def make(folder: str, config_json: str, seed: str, max_shard: str | None = None) -> None:
    config = json.loads(config_json)
    config_cls, model_cls = _classes(config)
    torch.manual_seed(int(seed))
    model = model_cls(config_cls(**config)).float()
    with torch.no_grad():  # norms away from ones, so a norm read from the wrong tensor shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
    kwargs = {"max_shard_size": max_shard} if max_shard else {}
    model.save_pretrained(folder, safe_serialization=True, **kwargs)


def logits(folder: str, tokens_pt: str, out_pt: str) -> None:
    config = json.loads(open(f"{folder}/config.json").read())
    _, model_cls = _classes(config)
    try:
        model = model_cls.from_pretrained(folder, dtype=torch.float32, attn_implementation="eager")
    except TypeError:  # transformers 4: torch_dtype
        model = model_cls.from_pretrained(folder, torch_dtype=torch.float32, attn_implementation="eager")
    with torch.no_grad():
        out = model(torch.load(tokens_pt)).logits
    torch.save(out, out_pt)


if __name__ == "__main__":
    {"make": make, "logits": logits}[sys.argv[1]](*sys.argv[2:])
