"""What one rank runs for task=train and task=profile: a Trainer, its failure recorded, the process
group shut down whatever happens. `elastic_entry` is the same under the elastic launcher."""
from __future__ import annotations

from typing import Any

from omegaconf import DictConfig, OmegaConf

from src.distributed.env import shutdown
from src.distributed.parallelize import inductor_config, release_cuda_graphs
from src.runtime import RunContext
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
                if cfg.kernels.cudagraphs:
                    release_cuda_graphs()
            finally:
                shutdown()


def elastic_entry(cfg_container: dict, ctx_fields: dict) -> dict[str, Any]:
    """What each rank runs under the elastic launcher (spawned: it rebuilds the config from a dict)."""
    cfg = OmegaConf.create(cfg_container)
    return train(cfg, RunContext(**ctx_fields))
