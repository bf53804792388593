"""What one rank runs for task=train and task=profile: a Trainer, its failure recorded, the process
group shut down whatever happens. `elastic_entry` is the same under the elastic launcher."""
from __future__ import annotations

import gc
from typing import Any

import torch
from omegaconf import DictConfig, OmegaConf

from src.distributed.env import shutdown
from src.distributed.launch import restore_rank_signals
from src.runtime import RunContext
from src.speed import restore_all
from src.speed.inductor import inductor_config, release_cuda_graphs
from src.train.trainer import Trainer


def train(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Train on this rank. Returns the summary (the same dict on every rank but for rank 0's GPU clock figures; rank 0 also writes it)."""
    with inductor_config(cfg):  # the compiled blocks' backward graphs compile inside train()
        trainer = Trainer(cfg, ctx)
        try:
            return trainer.train()
        except BaseException as exc:
            trainer.record_failure(exc)
            raise
        finally:
            try:
                if cfg.speed.cudagraphs:
                    release_cuda_graphs()
            finally:
                try:
                    shutdown()
                finally:
                    try:
                        free(trainer)
                    finally:
                        # torch's own FSDP2 functions back: the next run in this process decides its own
                        restore_all()


def free(trainer: Trainer) -> None:
    """Let the run's model, optimizer and batches go now. They sit in reference cycles (FSDP2's
    hooks, the step callbacks) that only Python's full collection breaks, and that runs rarely: the
    next job of an in-process sweep started with them still allocated, and counted them in its peak
    (a sweep's later jobs read more than twice their own peak). The trainer is emptied first so
    that a traceback still holding it holds nothing large; the caching allocator then hands the memory back."""
    device = trainer.env.device  # the first thing Trainer() sets, and free() runs only on a trainer built
    trainer.__dict__.clear()
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def elastic_entry(cfg_container: dict, ctx_fields: dict) -> dict[str, Any]:
    """What each rank runs under the elastic launcher (spawned: it rebuilds the config from a dict)."""
    restore_rank_signals()
    cfg = OmegaConf.create(cfg_container)
    return train(cfg, RunContext(**ctx_fields))
