"""Distributed checkpoints (torch.distributed.checkpoint) of model, optimizer, step and RNG states.

Layout: <folder>/step_00000010/ holds one DCP checkpoint (a .metadata file and each rank's shards),
`config.yaml` (the model's settings) and `manifest.json` (the step, the world size, and every other
file's size and SHA-256). A save is written into `step_N.partial/` and renamed to `step_N/` only
once every rank has finished writing and the manifest is in, so a save cut off half-way is never
taken for a checkpoint; `resume=auto` skips leftover `.partial` folders, saying which complete one it
resumes from instead. A load checks every file against the manifest first: a flipped byte in a shard
is refused, naming the file, before any rank trains on it. DCP reshards on load: a checkpoint saved
by 2 ranks loads into 1 or 4. `async_mode` overlaps the write with training: the state is staged
to host memory, written by a background thread over its own gloo group, and finalised (renamed,
old ones pruned to `keep_last`) at the next save or at the end.
"""
from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.nn as nn
from torch.distributed.checkpoint import DefaultLoadPlanner
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict, set_state_dict

from src.train.checkpoint_files import (  # noqa: F401 (latest_checkpoint, verify_checkpoint: this module's API too)
    MANIFEST,
    STEP_DIR,
    CheckpointError,
    _gb,
    _hash_files,
    checkpoint_step,
    complete_checkpoints,
    damage_message,
    damaged_files,
    file_sha256,
    latest_checkpoint,
    read_manifest,
    step_dir,
    verify_checkpoint,
)

log = logging.getLogger("src.checkpoint")


def state_bytes(state: Any) -> int:
    """Bytes of the tensors in a (nested) state dict: this rank's share of what a save writes."""
    if isinstance(state, dict):
        return sum(state_bytes(v) for v in state.values())
    if isinstance(state, (list, tuple)):
        return sum(state_bytes(v) for v in state)
    if torch.is_tensor(state):
        local = getattr(state, "_local_tensor", state)  # a DTensor writes its shard
        return local.numel() * local.element_size()
    return 0


def _rng_state(rank: int) -> dict[str, Any]:
    state = {f"cpu_rank{rank}": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state[f"cuda_rank{rank}"] = torch.cuda.get_rng_state()
    return state


class Checkpointer:
    def __init__(self, folder: Path, model: nn.Module, optimizer: torch.optim.Optimizer, keep_last: int = 2, async_mode: bool = False, config_yaml: str = ""):
        self.folder, self.model, self.optimizer = folder, model, optimizer
        self.keep_last, self.async_mode, self.config_yaml = keep_last, async_mode, config_yaml
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.pending: tuple[Any, Path, Path, float] | None = None
        self.expected_bytes = 0
        self.saves: list[dict[str, float]] = []
        self.load_s: float | None = None
        # DCP's async writer reduces plans in a background thread: give it a gloo group of its
        # own, so it never interleaves with the training loop's NCCL collectives.
        self.group = dist.new_group(backend="gloo") if (async_mode and dist.is_initialized()) else None

    def _state(self, step: int) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd, "step": torch.tensor(step), "rng": _rng_state(self.rank)}

    def save(self, step: int) -> None:
        """Checkpoint the state after `step` steps (the next run starts at `step`)."""
        self.wait()
        final = step_dir(self.folder, step)
        partial = final.with_name(final.name + ".partial")
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)  # a cut-off save of this step: its files are stale
            partial.mkdir(parents=True, exist_ok=True)
            (partial / "config.yaml").write_text(self.config_yaml)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        state = self._state(step)
        world = dist.get_world_size() if dist.is_initialized() else 1
        self.expected_bytes = state_bytes(state) * world  # FSDP2 shards evenly: each rank writes about as much
        try:
            if self.async_mode:
                future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
                self.pending = (future, partial, final, t0)
                self.saves.append({"step": step, "blocking_s": time.perf_counter() - t0})
                return
            dcp.save(state, checkpoint_id=str(partial))
        except (Exception, dcp.CheckpointException) as err:
            self._failed(partial, err)
        self.saves.append({"step": step})
        self._finalize(partial, final)
        self.saves[-1].update(blocking_s=time.perf_counter() - t0, total_s=time.perf_counter() - t0)

    def _failed(self, partial: Path, err: BaseException) -> None:
        """A save that could not be written: its partial folder removed (rank 0), the complete
        checkpoints before it kept, and one line naming the folder (and, for a full disk, the bytes)."""
        inner = _first_cause(err)
        # torch.save's zip writer reports a full disk as "unexpected pos", not ENOSPC: the room left says it
        full = (isinstance(inner, OSError) and inner.errno in (errno.ENOSPC, errno.EDQUOT)) or shutil.disk_usage(self.folder).free < self.expected_bytes
        if self.rank == 0:
            shutil.rmtree(partial, ignore_errors=True)
        kept = complete_checkpoints(self.folder)
        after = f"; {kept[-1].name} is kept" if kept else ""
        if full:
            free = shutil.disk_usage(self.folder).free
            raise CheckpointError(f"checkpoint {partial.name[:-len('.partial')]}: no space left in {self.folder}: a checkpoint needs about "
                                  f"{_gb(self.expected_bytes)}, {_gb(free)} is free{after}; free space or set checkpoint.folder elsewhere") from None
        raise CheckpointError(f"checkpoint {partial.name[:-len('.partial')]} could not be written to {self.folder}: {_one_line(inner)}{after}") from None

    def wait(self) -> None:
        """Finish an async save in flight: wait for the write, then rename and prune."""
        if self.pending is None:
            return
        future, partial, final, t0 = self.pending
        self.pending = None
        try:
            future.result()
        except (Exception, dcp.CheckpointException) as err:
            self._failed(partial, err)
        self._finalize(partial, final)
        self.saves[-1]["total_s"] = time.perf_counter() - t0

    def _finalize(self, partial: Path, final: Path) -> None:
        """Every rank's shards on disk: each hashes its share of the files, rank 0 writes the
        manifest, renames the folder and prunes to keep_last."""
        world = dist.get_world_size() if dist.is_initialized() else 1
        if dist.is_initialized():
            dist.barrier(group=self.group)  # every rank's shards are on disk
        names = sorted(f.name for f in partial.iterdir() if f.name != MANIFEST)
        mine = _hash_files(partial, names[self.rank::world])
        shares = [mine]
        if dist.is_initialized():
            shares = [None] * world
            dist.all_gather_object(shares, mine, group=self.group)
        if self.rank == 0:
            files = {k: v for share in shares for k, v in share.items()}
            manifest = {"step": int(final.name.split("_")[1]), "world_size": world, "torch": torch.__version__, "files": files}
            (partial / MANIFEST).write_text(json.dumps(manifest, indent=1))
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            size_mb = sum(f.stat().st_size for f in final.iterdir()) / 1e6
            if self.saves:
                self.saves[-1]["size_mb"] = size_mb
            log.info("checkpoint %s (%.1f MB)", final, size_mb)
            done = sorted((p for p in self.folder.iterdir() if STEP_DIR.match(p.name)), key=lambda p: p.name)
            for old in done[: max(0, len(done) - self.keep_last)]:
                shutil.rmtree(old, ignore_errors=True)
            for stale in self.folder.glob("step_*.partial"):  # cut-off saves older than this one
                if stale.name < final.name:
                    shutil.rmtree(stale, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def verify(self, path: Path) -> None:
        """Every rank hashes its share of the files; any damage is refused on every rank alike."""
        manifest = read_manifest(path)
        if manifest is None:
            if self.rank == 0:
                log.warning("%s has no %s (saved before checkpoints carried one): its files are not checked", path, MANIFEST)
            return
        world = dist.get_world_size() if dist.is_initialized() else 1
        problems = damaged_files(path, manifest, self.rank, world)
        if dist.is_initialized():
            every = [None] * world
            dist.all_gather_object(every, problems, group=self.group)
            problems = sorted(p for share in every for p in share)
        if problems:
            raise CheckpointError(damage_message(path, problems))

    def load(self, path: Path, verify: bool = True) -> int:
        """Restore model, optimizer and RNG from `path`; returns the step to continue from. `verify`:
        check its files against the manifest first (skipped where the launcher already did)."""
        checkpoint_step(path)
        t0 = time.perf_counter()
        if verify:
            self.verify(path)
        state = self._state(0)
        rng = {"rng": state.pop("rng")}
        try:
            dcp.load(state, checkpoint_id=str(path))
            # A rank that did not exist when the checkpoint was saved (2 ranks -> 4) keeps its own RNG.
            dcp.load(rng, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            raise CheckpointError(f"checkpoint {path} could not be loaded: {_one_line(_first_cause(err))}") from None
        kernels = optimizer_kernels(self.optimizer)
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
        keep_optimizer_kernels(self.optimizer, kernels)
        torch.set_rng_state(rng["rng"][f"cpu_rank{self.rank}"])
        if f"cuda_rank{self.rank}" in rng["rng"]:
            torch.cuda.set_rng_state(rng["rng"][f"cuda_rank{self.rank}"])
        step = int(state["step"])
        self.load_s = time.perf_counter() - t0
        log.info("resumed from %s at step %d (%.2f s)", path, step, self.load_s)
        return step


def _first_cause(err: BaseException) -> BaseException:
    """DCP gathers each rank's failure into one CheckpointException: the first rank's own."""
    causes = getattr(err, "failures", None) or {}
    inner = next(iter(causes.values()), err) if isinstance(causes, dict) else err
    inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) per rank
    while isinstance(inner, BaseException) and inner.__cause__ is not None and not isinstance(inner, OSError):
        inner = inner.__cause__
    return inner


def _one_line(err: BaseException) -> str:
    return (f"{type(err).__name__}: {err}".strip().splitlines() or [""])[0][:300]


KERNEL_KEYS = ("fused", "foreach", "capturable", "differentiable")
"""AdamW's param-group flags that say which kernels run it, not what it computes"""


def optimizer_kernels(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    return [{k: g[k] for k in KERNEL_KEYS if k in g} for g in optimizer.param_groups]


def keep_optimizer_kernels(optimizer: torch.optim.Optimizer, kernels: list[dict[str, Any]]) -> None:
    """Loading an optimizer's state dict replaces its param groups with the saved ones, kernel flags
    included: a run resumed under another optim.impl (or another pick of kernels=auto) would step
    with the checkpoint's kernels, e.g. for-loop AdamW from a Triton or foreach checkpoint, which
    then refuses the fused update's clipping divisor. The run's own flags go back, and each step
    count moves to where those kernels keep it (fused and capturable: the parameter's device)."""
    for group, flags in zip(optimizer.param_groups, kernels):
        group.update(flags)
        on_device = bool(flags.get("fused") or flags.get("capturable"))
        for p in group["params"]:
            step = optimizer.state.get(p, {}).get("step")
            if torch.is_tensor(step):
                # a DTensor's device is its own shard's, where fused AdamW keeps the count
                optimizer.state[p]["step"] = step.to(device=p.device if on_device else "cpu", dtype=torch.float32)


def export_safetensors(model: nn.Module, path: Path) -> None:
    """Gather the full (unsharded) weights and write one plain state_dict file from rank 0."""
    from safetensors.torch import save_file
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    full = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    if not dist.is_initialized() or dist.get_rank() == 0:
        save_file({k: v.contiguous() for k, v in full.items()}, str(path))
        readable_like_any_file(path)


def readable_like_any_file(path: Path) -> None:
    """safetensors writes through a private temporary file (mode 0600): give the weights the mode any
    new file gets here (0644 under the usual umask 022), so another user or a container can load them."""
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(path, 0o666 & ~umask)


def export_checkpoint(ckpt: Path, out: Path, model: nn.Module) -> None:
    """A DCP checkpoint to one safetensors file, in a single process (no ranks): `model` is a plain
    module of the checkpoint's architecture, on the CPU."""
    import warnings

    from safetensors.torch import save_file

    checkpoint_step(ckpt)
    state = {"model": model.state_dict()}
    with warnings.catch_warnings():  # "torch.distributed is disabled ... load in a single process": that is the point
        warnings.simplefilter("ignore", UserWarning)
        dcp.load(state, checkpoint_id=str(ckpt), no_dist=True)
    seen: set[int] = set()
    tensors = {}
    for k, v in state["model"].items():  # a tied weight (embedding and head) written under each name
        tensors[k] = v.contiguous().clone() if v.data_ptr() in seen else v.contiguous()
        seen.add(v.data_ptr())
    save_file(tensors, str(out))
    readable_like_any_file(Path(out))
