"""`kernels=auto`: fuse exactly the ops a diagnosis of this model marks memory-bound or latency-limited.

The diagnosis is `diagnosis.json` from `task=diagnose` (src/profiling/ncu_runner.py), named by
`kernels.diagnosis` (the file, or a run directory holding diagnose/diagnosis.json); left empty,
the newest one under ./outputs and ./multirun whose run config has this same model. The choice
is written into the job's config (`kernels.fused`, `kernels.diagnosis` made absolute) before the
ranks start, so every rank swaps the same modules and MLflow's params record it; rank 0 also
logs the reasons, one diagnosis line per op, as `kernels_auto.json`.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from kernels.triton.registry import REGISTRY
from src.compose import ConfigError
from src.profiling.diagnosis import fusable_ops

SEARCH_ROOTS = ("outputs", "multirun")


@dataclass
class AutoChoice:
    diagnosis: str
    """the diagnosis.json read"""
    device: str
    """the GPU it was measured on"""
    ops: dict[str, list[str]]
    """registry op -> the diagnosis lines that call for it"""

    def describe(self) -> str:
        return ", ".join(self.ops) or "nothing (no op is memory-bound or latency-limited)"


def make_one(cfg: DictConfig) -> str:
    return f"python -m src.run +exp=diagnose model={cfg.model.name} backend=cuda  (on an NVIDIA GPU with Nsight Compute)"


def _model_of(diagnosis: Path) -> dict | None:
    """The model config of the run that wrote `diagnosis` (RUN/diagnose/diagnosis.json next to RUN/config.yaml)."""
    config = diagnosis.parent.parent / "config.yaml"
    if not config.is_file():
        return None
    return OmegaConf.to_container(OmegaConf.load(config)).get("model")


def find_diagnosis(cfg: DictConfig, cwd: str | Path) -> Path:
    given = cfg.kernels.diagnosis
    if given:
        path = Path(given) if Path(given).is_absolute() else Path(cwd) / given
        if path.is_dir():
            path = next((p for p in (path / "diagnose" / "diagnosis.json", path / "diagnosis.json") if p.is_file()), path)
        if not path.is_file():
            raise ConfigError(f"kernels.diagnosis={given}: no diagnosis.json there; make one with `{make_one(cfg)}`")
        return path
    want = OmegaConf.to_container(cfg.model, resolve=True)
    found = [p for root in SEARCH_ROOTS for p in (Path(cwd) / root).glob("**/diagnose/diagnosis.json") if _model_of(p) == want]
    if not found:
        raise ConfigError(
            f"kernels=auto reads a diagnosis of model={cfg.model.name}, and none is under ./outputs or ./multirun; "
            f"make one with `{make_one(cfg)}`, or name one with kernels.diagnosis=PATH"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def choose(path: Path) -> AutoChoice:
    try:
        diagnosis: dict[str, Any] = json.loads(path.read_text())
        found = fusable_ops(diagnosis)
        ops = {op: found[op] for op in REGISTRY if op in found}  # the registry's order, whatever the diagnosis's
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"kernels.diagnosis={path}: not a diagnosis this version reads ({err}); make a new one with `python -m src.run +exp=diagnose`") from None
    return AutoChoice(str(path), str(diagnosis.get("device", "")), ops)


def auto_choice(cfg: DictConfig, cwd: str | Path) -> AutoChoice | None:
    """The choice `kernels=auto` makes for this config (None for any other kernels setting)."""
    if not cfg.kernels.auto:
        return None
    return choose(find_diagnosis(cfg, cwd))


def apply_auto_choice(cfg: DictConfig, cwd: str | Path) -> AutoChoice | None:
    """Write the choice into the job's config before the ranks start (see the module docstring)."""
    choice = auto_choice(cfg, cwd)
    if choice is not None:
        with open_dict(cfg):
            cfg.kernels.fused = list(choice.ops)
            cfg.kernels.diagnosis = choice.diagnosis
    return choice


def write_choice(choice: AutoChoice, swapped: dict[str, int], path: Path) -> dict:
    """kernels_auto.json: what was chosen, why, and what the model had to swap (0: the diagnosed op
    is not a module of this model, e.g. swiglu on the seed's plain SiLU MLP)."""
    record = {**asdict(choice), "swapped": swapped}
    path.write_text(json.dumps(record, indent=2))
    return record
