"""Distributed checkpoints (torch.distributed.checkpoint) of model, optimizer, step and RNG states.

Layout: <folder>/step_00000010/ holds one DCP checkpoint (a .metadata file and each rank's shards)
plus `config.yaml`. A save is written into `step_N.partial/` and renamed to `step_N/` only once
every rank has finished writing, so a save cut off half-way is never taken for a checkpoint;
leftover `.partial` folders are skipped with a warning. DCP reshards on load: a checkpoint saved
by 2 ranks loads into 1 or 4. `async_mode` overlaps the write with training: the state is staged
to host memory, written by a background thread over its own gloo group, and finalised (renamed,
old ones pruned to `keep_last`) at the next save or at the end.
"""
from __future__ import annotations

import logging
import os
import re
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

log = logging.getLogger("src.checkpoint")

_STEP_DIR = re.compile(r"^step_(\d{8})$")


class CheckpointError(RuntimeError):
    pass


def step_dir(folder: Path, step: int) -> Path:
    return folder / f"step_{step:08d}"


def latest_checkpoint(folder: Path) -> Path | None:
    """The newest complete checkpoint in `folder`; partial saves are skipped with a warning."""
    if not folder.is_dir():
        return None
    if not dist.is_initialized() or dist.get_rank() == 0:  # every rank looks; one says so
        for partial in sorted(folder.glob("step_*.partial")):
            log.warning("skipping %s: a save that did not finish", partial)
    complete = sorted((p for p in folder.iterdir() if _STEP_DIR.match(p.name) and (p / ".metadata").exists()), key=lambda p: p.name)
    return complete[-1] if complete else None


def checkpoint_step(path: Path) -> int:
    m = _STEP_DIR.match(path.name)
    if not m or not (path / ".metadata").exists():
        raise CheckpointError(f"checkpoint.resume={path}: not a complete checkpoint (a step_NNNNNNNN folder with DCP's .metadata)")
    return int(m.group(1))


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
            partial.mkdir(parents=True, exist_ok=True)
            (partial / "config.yaml").write_text(self.config_yaml)
        if dist.is_initialized():
            dist.barrier()
        t0 = time.perf_counter()
        state = self._state(step)
        if self.async_mode:
            future = dcp.async_save(state, checkpoint_id=str(partial), process_group=self.group)
            self.pending = (future, partial, final, t0)
            self.saves.append({"step": step, "blocking_s": time.perf_counter() - t0})
        else:
            dcp.save(state, checkpoint_id=str(partial))
            self.saves.append({"step": step})
            self._finalize(partial, final)
            self.saves[-1].update(blocking_s=time.perf_counter() - t0, total_s=time.perf_counter() - t0)

    def wait(self) -> None:
        """Finish an async save in flight: wait for the write, then rename and prune."""
        if self.pending is None:
            return
        future, partial, final, t0 = self.pending
        self.pending = None
        future.result()
        self._finalize(partial, final)
        self.saves[-1]["total_s"] = time.perf_counter() - t0

    def _finalize(self, partial: Path, final: Path) -> None:
        if dist.is_initialized():
            dist.barrier(group=self.group)  # every rank's shards are on disk
        if self.rank == 0:
            if final.exists():
                shutil.rmtree(final)
            partial.rename(final)
            size_mb = sum(f.stat().st_size for f in final.iterdir()) / 1e6
            if self.saves:
                self.saves[-1]["size_mb"] = size_mb
            log.info("checkpoint %s (%.1f MB)", final, size_mb)
            done = sorted((p for p in self.folder.iterdir() if _STEP_DIR.match(p.name)), key=lambda p: p.name)
            for old in done[: max(0, len(done) - self.keep_last)]:
                shutil.rmtree(old, ignore_errors=True)
        if dist.is_initialized():
            dist.barrier(group=self.group)

    def load(self, path: Path) -> int:
        """Restore model, optimizer and RNG from `path`; returns the step to continue from."""
        checkpoint_step(path)
        t0 = time.perf_counter()
        state = self._state(0)
        rng = {"rng": state.pop("rng")}
        try:
            dcp.load(state, checkpoint_id=str(path))
            # A rank that did not exist when the checkpoint was saved (2 ranks -> 4) keeps its own RNG.
            dcp.load(rng, checkpoint_id=str(path), planner=DefaultLoadPlanner(allow_partial_load=True))
        except (Exception, dcp.CheckpointException) as err:  # DCP's own exception is a BaseException
            causes = getattr(err, "failures", None) or {}
            inner = next(iter(causes.values()), err) if isinstance(causes, dict) else err
            inner = inner[0] if isinstance(inner, tuple) else inner  # (exception, traceback) per rank
            first = (f"{type(inner).__name__}: {inner}".strip().splitlines() or [""])[0][:300]
            raise CheckpointError(f"checkpoint {path} could not be loaded: {first}") from None
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
