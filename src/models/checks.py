"""A model config that composes but cannot be built: one line naming the value and the fix, before any
rank starts (train/checks.py and edge/checks.py call it). What every architecture shares is checked
here; each architecture's own checks live in its folder (src/models/ARCH/checks.py)."""
from __future__ import annotations

from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.models.config import HF, arch_configs


def model_refusal(m: DictConfig) -> str | None:
    """Why model.* cannot make a model, in one line; None where it can."""
    from src.models import ARCHS

    configs = arch_configs()
    if OmegaConf.is_missing(m, "arch"):
        return (f"model={m.name}: its YAML names no architecture; make its first line "
                f"`defaults: [/base_model_ARCH@_here_, _self_]` with ARCH one of {', '.join(configs)}")
    if m.arch == HF:
        return "model=hf takes the architecture from model.hf_path's config.json: set model.hf_path=DIR"
    if m.arch not in configs:
        return f"model.arch={m.arch}: no such architecture; one of {', '.join(configs)} (a folder of src/models/)"
    schema = OmegaConf.get_type(m)
    if schema is not configs[m.arch] and schema in configs.values():
        family = [a for a, s in configs.items() if s is schema][0]
        return (f"model.arch={m.arch}, and model={m.name} holds {family}'s settings; the model's YAML names its architecture: "
                f"pick a model of the {m.arch} family instead of setting model.arch")
    if min(m.dim, m.n_layers, m.n_heads, m.vocab_size) < 1 or m.ffn_hidden < 0:
        return ("model.dim, n_layers, n_heads and vocab_size must all be positive (ffn_hidden 0 or more); "
                f"got dim={m.dim} n_layers={m.n_layers} n_heads={m.n_heads} vocab_size={m.vocab_size} ffn_hidden={m.ffn_hidden}")
    why = ARCHS[str(m.arch)].refusal(m)
    if why is None and m.hf_path:
        return hf_refusal(m)
    return why


def hf_refusal(m: DictConfig) -> str | None:
    """model.hf_path: a Hugging Face folder this architecture reads, of this model's shape."""
    from src.models import ARCHS

    adapter = ARCHS[str(m.arch)].hf
    readers = [a for a, arch in ARCHS.items() if arch.hf is not None]
    if adapter is None:
        return f"model.hf_path={m.hf_path}: model.arch={m.arch} reads no Hugging Face folder; use a model of {', '.join(readers)}, or model=hf"
    if not Path(m.hf_path).is_dir():
        return f"model.hf_path={m.hf_path}: no such folder; give a Hugging Face folder (config.json, model.safetensors)"
    return adapter.check(m, Path(m.hf_path))
