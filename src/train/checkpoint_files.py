"""A checkpoint folder's files, apart from DCP (src/train/checkpoint.py writes and loads them):
the step_NNNNNNNN folders, which are complete, the manifest of every file's size and SHA-256, and
the check of a folder against it. What the launcher reads before any rank starts
(src/train/resume_check.py), without importing torch.distributed.checkpoint (0.7 s a process)."""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch.distributed as dist

log = logging.getLogger("src.checkpoint")

STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}"


def complete_checkpoints(folder: Path) -> list[Path]:
    """The complete checkpoints in `folder` (a step_NNNNNNNN folder holding DCP's .metadata), oldest first."""
    if not folder.is_dir():
        return []
    return sorted((p for p in folder.iterdir() if STEP_DIR.match(p.name) and (p / ".metadata").exists()), key=lambda p: p.name)


def latest_checkpoint(folder: Path, say: bool = True) -> Path | None:
    """The newest complete checkpoint in `folder`; a partial save after it is skipped, saying so
    (`say`: rank 0 logs it; every rank looks)."""
    complete = complete_checkpoints(folder)
    latest = complete[-1] if complete else None
    if say and folder.is_dir() and (not dist.is_initialized() or dist.get_rank() == 0):
        for partial in sorted(folder.glob("step_*.partial")):
            instead = f"resuming from {latest.name} instead" if latest is not None else "no complete checkpoint: starting fresh"
            log.warning("skipping %s: a save that did not finish; %s", partial, instead)
    return latest


def checkpoint_step(path: Path) -> int:
    m = STEP_DIR.match(path.name)
    if not m or not (path / ".metadata").exists():
        raise CheckpointError(f"checkpoint.resume={path}: not a complete checkpoint (a step_NNNNNNNN folder with DCP's .metadata)")
    return int(m.group(1))


MANIFEST = "manifest.json"
_HASH_CHUNK = 8 << 20  # 8 MiB reads: hashlib releases the GIL on each, so threads hash files side by side


def file_sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_HASH_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def _hash_files(folder: Path, names: list[str]) -> dict[str, dict[str, Any]]:
    """{name: {bytes, sha256}}; a thread a core (SHA-256 runs at about 1.5 GB/s a core)."""
    with ThreadPoolExecutor(max_workers=max(1, min(len(names), os.cpu_count() or 1))) as pool:
        digests = list(pool.map(lambda n: file_sha256(folder / n), names))
    return {n: {"bytes": (folder / n).stat().st_size, "sha256": d} for n, d in zip(names, digests)}


def read_manifest(path: Path) -> dict[str, Any] | None:
    """The checkpoint's manifest, or None for one saved without it (before manifests were written)."""
    f = path / MANIFEST
    if not f.exists():
        return None
    try:
        return json.loads(f.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CheckpointError(f"{f}: not a readable manifest ({err}); the checkpoint is damaged") from None


def damaged_files(path: Path, manifest: dict[str, Any], rank: int = 0, world: int = 1) -> list[str]:
    """This rank's share of the files (every world-th) that are missing, of another size, or hash
    otherwise than the manifest says; each as '<name>: <what is wrong>'."""
    names = sorted(manifest["files"])[rank::world]
    problems, present = [], []
    for name in names:
        f, want = path / name, manifest["files"][name]
        if not f.exists():
            problems.append(f"{name}: missing")
        elif f.stat().st_size != want["bytes"]:
            problems.append(f"{name}: {f.stat().st_size} bytes, the manifest says {want['bytes']}")
        else:
            present.append(name)
    got = _hash_files(path, present) if present else {}
    problems += [f"{n}: SHA-256 differs from the manifest's" for n in present if got[n]["sha256"] != manifest["files"][n]["sha256"]]
    return problems


def damage_message(path: Path, problems: list[str]) -> str:
    more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
    return (f"checkpoint {path} is damaged: {problems[0]}{more}; resume from an earlier one "
            "(checkpoint.resume=PATH) or start fresh (checkpoint.resume=none)")


def verify_checkpoint(path: Path) -> dict[str, Any] | None:
    """Every file of `path` against its manifest, in this process; raises CheckpointError naming the
    first damaged file. Returns the manifest (None for a checkpoint saved without one)."""
    manifest = read_manifest(path)
    if manifest is not None:
        problems = damaged_files(path, manifest)
        if problems:
            raise CheckpointError(damage_message(path, problems))
    return manifest


def _gb(n: float) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"
