"""model.arch -> its Architecture, one per folder of src/models/ (its architecture.py), and the
config-to-constructor boundary: build_model and meta_model."""
from __future__ import annotations

import importlib
import inspect
from collections.abc import Mapping

import torch
from omegaconf import DictConfig, OmegaConf
from torch.overrides import TorchFunctionMode

from src.models.config import arch_configs
from src.models.protocol import Architecture, CausalLM

ARCHS: dict[str, Architecture] = {arch: importlib.import_module(f"src.models.{arch}.architecture").ARCHITECTURE for arch in arch_configs()}
"""a new architecture is a folder under src/models/ (config.py, model.py, architecture.py) and its conf/model/*.yaml"""


def architecture(arch: str) -> Architecture:
    return ARCHS[str(arch)]


def arguments(arch: str) -> set[str]:
    """The constructor arguments of `arch`'s class: the model.* fields it reads."""
    return set(inspect.signature(ARCHS[arch].model.__init__).parameters) - {"self"}


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
