"""Plain nn.Modules: constructor arguments only, never the config object (build_model is the boundary)."""
from __future__ import annotations

from omegaconf import DictConfig, OmegaConf

from src.models.mini_llm import MiniLLM


def build_model(model_cfg: DictConfig) -> MiniLLM:
    """The config-to-constructor boundary: the model itself only sees plain arguments."""
    kwargs = {k: v for k, v in OmegaConf.to_container(model_cfg, resolve=True).items() if k != "name"}
    return MiniLLM(**kwargs)
