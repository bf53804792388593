"""Plain nn.Modules, one folder per architecture, each behind the contract in protocol.py:
constructor arguments only, never the config object (build_model is the boundary)."""
from __future__ import annotations

import inspect
from collections.abc import Mapping

import torch.nn as nn
from omegaconf import DictConfig, OmegaConf

from src.models.llama3 import Llama3
from src.models.mini_llm import MiniLLM
from src.models.protocol import CausalLM

ARCHS: dict[str, type[nn.Module]] = {"mini_llm": MiniLLM, "llama3": Llama3}
"""model.arch -> the class; a new architecture is a folder under src/models/ and a line here"""

# model.* fields that are not constructor arguments: every architecture's, and one architecture's own
COMMON = ("name", "arch")
LOADERS = {"llama3": ("hf_path",)}
"""arch -> the fields that say where its weights come from (read by parallelize, not the constructor)"""


def arguments(arch: str) -> set[str]:
    """The constructor arguments of `arch`'s class: the model.* fields it reads."""
    return set(inspect.signature(ARCHS[arch].__init__).parameters) - {"self"}


def foreign_fields(model_cfg: DictConfig, defaults: dict) -> list[str]:
    """model.* fields set away from their schema default that this architecture does not read."""
    arch = str(model_cfg.arch)
    own = arguments(arch) | set(COMMON) | set(LOADERS.get(arch, ()))
    return [k for k, v in model_cfg.items() if k not in own and k in defaults and v != defaults[k]]


def build_model(model_cfg: DictConfig | Mapping) -> CausalLM:
    """The config-to-constructor boundary: the model itself only sees plain arguments. `model_cfg`:
    the model group of a run's config (or a checkpoint's config.yaml), as a DictConfig or a dict."""
    cfg = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    arch = str(cfg.get("arch", "mini_llm"))
    own = arguments(arch)
    return ARCHS[arch](**{k: v for k, v in cfg.items() if k in own})
