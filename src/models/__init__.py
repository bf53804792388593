"""Plain nn.Modules, one folder per architecture, each behind the contract in protocol.py:
constructor arguments only, never the config object (build_model is the boundary)."""
from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
import torch.nn as nn
from omegaconf import DictConfig, OmegaConf
from torch.overrides import TorchFunctionMode

from src.models.llama3 import Llama3
from src.models.llama3 import checks as llama3_checks
from src.models.mini_llm import MiniLLM
from src.models.mini_llm import checks as mini_llm_checks
from src.models.protocol import CausalLM


@dataclass(frozen=True)
class Architecture:
    model: type[nn.Module]
    """the class, built from the model.* fields its constructor names"""
    refusal: Callable[[DictConfig], str | None]
    """its own settings checks (src/models/ARCH/checks.py): one line, or None"""
    loaders: tuple[str, ...] = ()
    """model.* fields that say where its weights come from (read by parallelize, not the constructor)"""


ARCHS: dict[str, Architecture] = {
    "mini_llm": Architecture(MiniLLM, mini_llm_checks.refusal),
    "llama3": Architecture(Llama3, llama3_checks.refusal, ("hf_path",)),
}
"""model.arch -> the architecture; a new one is a folder under src/models/, a line here and its conf/model/*.yaml"""

COMMON = ("name", "arch")  # model.* fields of every architecture that no constructor reads


def arguments(arch: str) -> set[str]:
    """The constructor arguments of `arch`'s class: the model.* fields it reads."""
    return set(inspect.signature(ARCHS[arch].model.__init__).parameters) - {"self"}


def foreign_fields(model_cfg: DictConfig, defaults: dict) -> list[str]:
    """model.* fields set away from their schema default that this architecture does not read."""
    arch = str(model_cfg.arch)
    own = arguments(arch) | set(COMMON) | set(ARCHS[arch].loaders)
    return [k for k, v in model_cfg.items() if k not in own and k in defaults and v != defaults[k]]


def build_model(model_cfg: DictConfig | Mapping) -> CausalLM:
    """The config-to-constructor boundary: the model itself only sees plain arguments. `model_cfg`:
    the model group of a run's config (or a checkpoint's config.yaml), as a DictConfig or a dict."""
    cfg = OmegaConf.to_container(model_cfg, resolve=True) if isinstance(model_cfg, DictConfig) else dict(model_cfg)
    arch = str(cfg.get("arch", "mini_llm"))
    own = arguments(arch)
    return ARCHS[arch].model(**{k: v for k, v in cfg.items() if k in own})


class _ShapesOnly(TorchFunctionMode):
    """torch.nn.init's fills skipped (each returns its tensor as it is): a meta tensor holds no values."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) == "torch.nn.init":
            return args[0] if args else (kwargs or {})["tensor"]
        return func(*args, **(kwargs or {}))


def meta_model(model_cfg: DictConfig | Mapping) -> CausalLM:
    """build_model on the meta device: parameters with their shapes and dtypes and no values, for
    counting or to materialize (src/distributed/parallelize.py). The constructors' init fills are
    skipped: on meta, torch runs them through its reference implementations, whose first call
    imports torch._dynamo, 1.4 s of CPU in the launcher, which never compiles (the memory estimate,
    the checkpoint and edge checks). A rank imports Dynamo anyway with FSDP2 (launch.py preloads it)."""
    with torch.device("meta"), _ShapesOnly():
        return build_model(model_cfg)

