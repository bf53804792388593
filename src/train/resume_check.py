"""What a run's checkpoints need, checked before any rank or MLflow run starts.

- The checkpoint it will resume from (checkpoint.resume: auto, none, or a folder) is complete, its
  files match the manifest written with them (src/train/checkpoint_files.py), and its model tensors have
  the names, shapes and dtypes of the model this config builds. A world size other than the one it
  was saved by is fine: DCP reshards on load.
- The checkpoint folder can be written, and its filesystem has room for one more checkpoint.

Each failure is a ConfigError: one line naming the file or setting and the way out.
"""
from __future__ import annotations

import logging
import shutil
import tempfile
from pathlib import Path

import torch
from omegaconf import DictConfig

from src.config.compose import ConfigError
from src.train.checkpoint_files import (
    MANIFEST,
    CheckpointError,
    _gb,
    checkpoint_step,
    complete_checkpoints,
    latest_checkpoint,
    verify_checkpoint,
)

log = logging.getLogger("src.checkpoint")

# AdamW's two fp32 moments next to the fp32 weights (12 bytes a parameter), plus the RNG, step and
# DCP's metadata, which are small: what a model's checkpoint takes on disk.
CHECKPOINT_BYTES_PER_PARAM = 12
# Room asked for beyond one checkpoint's size: keep_last=2 holds the newest two while a third is written.
FREE_SPACE_MARGIN = 1.1


def checkpoint_folder(cfg: DictConfig, run_dir: Path | None) -> Path | None:
    ck = cfg.checkpoint
    return Path(ck.folder) if ck.folder else (run_dir / "checkpoints" if run_dir is not None else None)


def resume_target(cfg: DictConfig, run_dir: Path | None) -> Path | None:
    """The checkpoint this run would resume from (None: starts fresh)."""
    resume = str(cfg.checkpoint.resume)
    if resume == "none":
        return None
    if resume != "auto":
        path = Path(resume)
        try:
            checkpoint_step(path)
        except CheckpointError as err:
            complete = complete_checkpoints(path.parent) or complete_checkpoints(path)
            hint = f"; the newest complete one there is {complete[-1]}" if complete else ""
            raise ConfigError(f"{err}{hint}") from None
        return path
    folder = checkpoint_folder(cfg, run_dir)
    return latest_checkpoint(folder, say=False) if folder is not None else None


def model_tensors(cfg: DictConfig) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model this config builds (on the meta device: no memory)."""
    from src.models import meta_model

    model = meta_model(cfg.model)
    return {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}


def saved_tensors(path: Path) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    """{name: (shape, dtype)} of the model tensors in a DCP checkpoint, from its .metadata alone."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    try:
        meta = FileSystemReader(str(path)).read_metadata()
    except Exception as err:
        raise ConfigError(f"checkpoint {path}: its .metadata cannot be read ({type(err).__name__}: {err}); the checkpoint is damaged") from None
    return {k[len("model."):]: (tuple(m.size), m.properties.dtype) for k, m in meta.state_dict_metadata.items()
            if k.startswith("model.") and isinstance(m, TensorStorageMetadata)}


def check_compatible(cfg: DictConfig, path: Path) -> None:
    """The checkpoint's model tensors against the model this config builds: one line for the first
    difference, naming the setting that would make them agree."""
    want, have = model_tensors(cfg), saved_tensors(path)
    missing = sorted(set(want) - set(have))
    if missing:
        extra = sorted(set(have) - set(want))
        what = f"holds {extra[0]} instead" if extra else "lacks it"
        raise ConfigError(f"checkpoint {path} was saved from another model: model {cfg.model.name} has {missing[0]}, the checkpoint {what}"
                          f"{_saved_model(path)}; resume it with the model it was saved with, or set checkpoint.resume=none")
    for name, (shape, dtype) in want.items():
        saved_shape, saved_dtype = have[name]
        if saved_shape != shape:
            raise ConfigError(f"checkpoint {path} was saved from another model: {name} is {list(saved_shape)} there, {list(shape)} in "
                              f"model {cfg.model.name}{_saved_model(path)}; resume it with the model it was saved with, or set checkpoint.resume=none")
        if saved_dtype != dtype:
            raise ConfigError(f"checkpoint {path}: {name} is {saved_dtype} there, the model holds {dtype}; "
                              "it was not saved by this project's training (its weights are fp32 masters)")


def _saved_model(path: Path) -> str:
    """' (saved with model.dim=..., ...)': the settings the checkpoint's config.yaml records."""
    import yaml

    f = path / "config.yaml"
    try:
        saved = yaml.safe_load(f.read_text()) if f.exists() else None
    except yaml.YAMLError:
        return ""
    if not isinstance(saved, dict):
        return ""
    keys = ("name", "dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size")
    return " (saved with " + ", ".join(f"model.{k}={saved[k]}" for k in keys if k in saved) + ")"


_VERIFIED: set[tuple[str, float]] = set()
"""(checkpoint, its manifest's mtime) verified in this process: the command's preflight and its job
are one process, and hash a checkpoint once"""


def check_resume(cfg: DictConfig, run_dir: Path | None) -> Path | None:
    """The checkpoint the run resumes from, verified (files and model) here, before ranks start; None
    when it starts fresh. A partial save newer than it is skipped, which the ranks say in the log."""
    path = resume_target(cfg, run_dir)
    if path is None:
        return None
    manifest_file = path / MANIFEST
    key = (str(path.resolve()), manifest_file.stat().st_mtime if manifest_file.exists() else 0.0)
    if key not in _VERIFIED:
        try:
            manifest = verify_checkpoint(path)
        except CheckpointError as err:
            earlier = [p for p in complete_checkpoints(path.parent) if p.name < path.name]
            message = str(err)
            if earlier:
                message = message.replace("resume from an earlier one (checkpoint.resume=PATH)", f"resume from an earlier one (checkpoint.resume={earlier[-1]})")
            raise ConfigError(message) from None
        if manifest is None:
            log.warning("%s has no manifest (saved before checkpoints carried one): its files are not checked", path)
        _VERIFIED.add(key)
    check_compatible(cfg, path)
    return path


def check_checkpoints(cfg: DictConfig, run_dir: Path | None) -> Path | None:
    """Both checks of this module for a training job; returns the checkpoint it resumes from, verified."""
    if cfg.task.name not in ("train", "profile"):
        return None
    check_checkpoint_folder(cfg, run_dir)
    return check_resume(cfg, run_dir)


def estimated_checkpoint_bytes(cfg: DictConfig) -> int:
    from src.models import meta_model

    n_params = meta_model(cfg.model).num_params(non_embedding=False)
    return n_params * CHECKPOINT_BYTES_PER_PARAM


def check_checkpoint_folder(cfg: DictConfig, run_dir: Path | None) -> None:
    """A run that saves (checkpoint.enabled, or the save on a preemption signal): its folder, or the
    nearest folder above it that exists, takes a file, and has room for one more checkpoint."""
    folder = checkpoint_folder(cfg, run_dir)
    if folder is None or not (cfg.checkpoint.enabled or cfg.checkpoint.on_signal):
        return
    folder = folder if folder.is_absolute() else Path.cwd() / folder
    existing = folder
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    setting = f"checkpoint.folder={cfg.checkpoint.folder}" if cfg.checkpoint.folder else f"the checkpoint folder {folder}"
    if not existing.is_dir():
        raise ConfigError(f"{setting}: {existing} is a file, not a folder; set checkpoint.folder to a folder")
    try:  # a real probe: permission bits say nothing of read-only mounts or root's rights
        Path(tempfile.mkdtemp(prefix=".perflab_probe_", dir=existing)).rmdir()
    except OSError as err:
        raise ConfigError(f"{setting}: cannot write in {existing} ({err.strerror}); set checkpoint.folder to a writable folder") from None
    if not cfg.checkpoint.enabled:
        return  # a preemption save is not sure to happen: no room asked for ahead
    need = estimated_checkpoint_bytes(cfg) * FREE_SPACE_MARGIN
    free = shutil.disk_usage(existing).free
    if free < need:
        raise ConfigError(f"{setting}: a checkpoint of model {cfg.model.name} takes about {_gb(need)}, {existing} has {_gb(free)} free; "
                          "free space or set checkpoint.folder elsewhere")


def stopped_run(root: Path, overrides: list[str]) -> tuple[Path, dict] | None:
    """The run folder under `root` (outputs/DATE/TIME) that this command continues, with its summary:
    the newest folder the same command (the same overrides, hydra.* aside) ran in, where that run
    stopped on a signal and saved a checkpoint. None where the newest such run finished, failed or
    left no summary (killed outright): the command then starts afresh."""
    import json

    import yaml

    ours = sorted(o for o in overrides if not o.lstrip("+~").startswith("hydra"))
    for overrides_file in sorted(root.glob("*/*/.hydra/overrides.yaml"), reverse=True):  # DATE/TIME sort as time does
        folder = overrides_file.parent.parent
        try:
            theirs = yaml.safe_load(overrides_file.read_text()) or []
        except (OSError, yaml.YAMLError):
            continue
        if sorted(map(str, theirs)) != ours:
            continue
        try:
            summary = json.loads((folder / "summary.json").read_text())
        except (OSError, json.JSONDecodeError):
            return None
        if summary.get("status") != "preempted" or latest_checkpoint(folder / "checkpoints", say=False) is None:
            return None
        return folder, summary
    return None
