"""The model group's schemas: what every architecture shares (ModelConfig), and each architecture's
own dataclass, found in its folder (src/models/ARCH/config.py, a subclass of ModelConfig named by
its CONFIG). A model's YAML pulls its architecture's schema (`/base_model_ARCH@_here_`), so a
setting another architecture has (`model=tiny model.n_kv_heads=2`) fails when the config is
composed. `model=hf` takes the architecture and the shape from a Hugging Face folder's config.json
(`from_hf`), as transformers' Auto classes do.

Torch-free, and part of the config layer (src/config/schema.py registers these schemas): `--help`
and composing read it.
"""
from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, fields
from enum import StrEnum
from functools import cache
from pathlib import Path
from typing import ClassVar

from omegaconf import MISSING, DictConfig, OmegaConf

MODELS_DIR = Path(__file__).resolve().parent
HF = "hf"
"""model.arch of conf/model/hf.yaml: the architecture is config.json's (from_hf)"""


class Mlp(StrEnum):
    silu = "silu"
    swiglu = "swiglu"


@dataclass
class ModelConfig:
    """What every architecture's model config holds; each architecture adds its own fields."""

    name: str = MISSING
    arch: str = MISSING
    """the architecture, a folder of src/models/ (mini_llm, llama3, ...); set by the model's YAML"""
    vocab_size: int = 32000
    """tokens in the vocabulary (embedding rows and head columns)"""
    dim: int = 2048
    """model width"""
    n_layers: int = 12
    n_heads: int = 16
    mlp: Mlp = Mlp.silu
    """silu: the seed's Linear -> SiLU -> Linear; swiglu: LLaMA's down(silu(gate(x)) * up(x))"""
    ffn_hidden: int = 0
    """hidden width of the MLP when set (LLaMA-7B: 11008 for dim 4096); 0: the architecture's own rule"""
    causal: bool = True
    """causal attention mask; the seed's script has none, so +exp=fsdp4 turns it off to match it"""
    norm_eps: float = 1e-6
    init_std: float = 0.02
    hf_path: str = ""
    """a Hugging Face folder (config.json, model.safetensors) whose weights the run starts from; its
    config.json must match this model's shape (model=hf takes the shape from it)"""

    HF_ARCHITECTURES: ClassVar[tuple[str, ...]] = ()
    """the `architectures` of a Hugging Face config.json this architecture reads (none: no adapter)"""
    GGUF_ARCHS: ClassVar[dict[str, str]] = {}
    """of HF_ARCHITECTURES, those llama.cpp runs -> its `general.architecture` (python -m src.export --gguf)"""

    @classmethod
    def from_hf(cls, config: dict) -> dict:
        """The model.* fields a Hugging Face config.json of one of HF_ARCHITECTURES describes."""
        raise HFConfigError(f"architectures={config.get('architectures')}: model.arch={cls.arch} reads no Hugging Face folder")


class HFConfigError(ValueError):
    """A Hugging Face folder whose config.json cannot describe a model here; the message names the fix."""


@cache
def arch_configs() -> dict[str, type[ModelConfig]]:
    """{arch: its config dataclass}, one per folder of src/models/ that has a config.py."""
    found = {}
    for folder in sorted(p for p in MODELS_DIR.iterdir() if (p / "config.py").is_file()):
        schema = importlib.import_module(f"src.models.{folder.name}.config").CONFIG
        if not (isinstance(schema, type) and issubclass(schema, ModelConfig)) or schema.arch != folder.name:
            raise TypeError(f"src/models/{folder.name}/config.py: CONFIG must be a ModelConfig subclass whose arch is {folder.name!r}")
        found[folder.name] = schema
    return found


def hf_config(folder: str | Path) -> dict:
    """A Hugging Face folder's config.json, as a dict; HFConfigError naming what is wrong."""
    path = Path(folder) / "config.json"
    if not Path(folder).is_dir():
        raise HFConfigError(f"model.hf_path={folder}: no such folder; give a Hugging Face folder (config.json, model.safetensors)")
    if not path.is_file():
        raise HFConfigError(f"model.hf_path={folder}: no config.json there; give a Hugging Face folder (config.json, model.safetensors)")
    try:
        config = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise HFConfigError(f"model.hf_path={folder}: config.json is cut off or not JSON ({err})") from None
    if not isinstance(config, dict):
        raise HFConfigError(f"model.hf_path={folder}: config.json holds no settings object")
    return config


def hf_family(config: dict, folder: str | Path) -> type[ModelConfig]:
    """The architecture whose config reads config.json's `architectures`."""
    named = (config.get("architectures") or ["?"])[0]
    readers = {a: schema for schema in arch_configs().values() for a in schema.HF_ARCHITECTURES}
    if named not in readers:
        raise HFConfigError(f"model.hf_path={folder}: architectures={config.get('architectures')}; read are {', '.join(readers)}")
    return readers[named]


def from_hf(model: DictConfig, overrides: list[str]) -> DictConfig:
    """model=hf: the model node of config.json's architecture and shape, then the command line's own
    model.* settings on top (checked against the checkpoint like any model's). Raises HFConfigError."""
    folder = model.hf_path
    if not folder:
        raise HFConfigError("model=hf reads the architecture and the shape from a Hugging Face folder: set model.hf_path=DIR")
    config = hf_config(folder)
    schema = hf_family(config, folder)
    node = OmegaConf.structured(schema(name=HF, hf_path=str(folder), **schema.from_hf(config)))
    for key in _model_keys(overrides):
        if key not in {f.name for f in fields(schema)}:
            raise HFConfigError(f"model.{key}: not a setting of model.arch={schema.arch} (config.json's architecture); drop it")
        if key not in ("name", "arch", "hf_path"):
            node[key] = model[key]
    return node


def _model_keys(overrides: list[str]) -> list[str]:
    """The model.* keys a command line sets (`model.n_layers=2`, `+model.x=1`), not the group (`model=hf`)."""
    keys = []
    for override in overrides:
        key = override.lstrip("+~").split("=", 1)[0]
        if key.startswith("model.") and "@" not in key:
            keys.append(key.removeprefix("model.").split(".")[0])
    return keys


def resolve(cfg: DictConfig, overrides: list[str]) -> DictConfig:
    """`cfg` with model=hf replaced by the model its folder holds (in place); any other model as it is."""
    if OmegaConf.select(cfg, "model.arch", throw_on_missing=False) == HF:
        with _writable(cfg):
            cfg.model = from_hf(cfg.model, overrides)
    return cfg


class _writable:
    """Hydra hands its config read-only in places (struct and readonly flags); lifted for one assignment."""

    def __init__(self, cfg: DictConfig):
        self.cfg = cfg

    def __enter__(self):
        self.flags = (self.cfg._get_node_flag("readonly"), self.cfg._get_node_flag("struct"))
        OmegaConf.set_readonly(self.cfg, False)
        OmegaConf.set_struct(self.cfg, False)

    def __exit__(self, *exc):
        OmegaConf.set_readonly(self.cfg, self.flags[0])
        OmegaConf.set_struct(self.cfg, self.flags[1])
