"""A run's speed settings: which recipes run (decide), refusals before any rank starts (refusal),
and every lever put in place in one call (install: the model's own levers, then FSDP2's recipes on
the sharded model, install_fsdp).

`auto` runs a recipe on a CUDA run where it applies (the run's shape: ranks a shard group, dtypes,
the optimizer) and the recipe may run on this torch; `on` runs it wherever it applies, on any
device (on a CPU its Triton kernels run only under Triton's interpreter; elsewhere torch's own path
takes the call); `off` leaves torch's own path.
"""
from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh

from src.dtypes import torch_dtype
from src.speed import RECIPES, keep_unsharded

log = logging.getLogger("src.train")
FSDP_STRATEGIES = ("fsdp2", "hsdp")


@dataclass(frozen=True)
class Verdict:
    on: bool
    """whether the recipe runs in this run"""
    warning: str | None = None
    """the one line saying why an auto recipe is off on this torch; None where it is on, or does not apply"""


def asked(cfg: DictConfig, name: str) -> str:
    """speed.NAME as auto, on or off (keep_unsharded is a plain switch: true is on)."""
    value = cfg.speed[name]
    if isinstance(value, bool):
        return "on" if value else "off"
    return str(value)


def applies(name: str, cfg: DictConfig, shard_ranks: int, reduce_dtype: str) -> bool:
    """Whether the recipe has anything to do in a run of this shape (whatever the device)."""
    if cfg.sharding.strategy not in FSDP_STRATEGIES:
        return False
    return {
        "grad_upcast": torch_dtype(reduce_dtype) in (torch.bfloat16, torch.float16),
        "reduce_copy_in": True,
        "one_rank_copies": shard_ranks == 1,
        "cast_in_step": (shard_ranks == 1 and str(cfg.optim.impl) == "triton" and not cfg.sharding.cpu_offload
                         and torch_dtype(cfg.precision.param_dtype) == torch.bfloat16),
        "keep_unsharded": True,
    }[name]


def decide(cfg: DictConfig, shard_ranks: int, device_type: str, reduce_dtype: str) -> dict[str, Verdict]:
    """Every recipe's verdict for this run."""
    force = bool(cfg.speed.force_unverified)
    verdicts: dict[str, Verdict] = {}
    for name, recipe in RECIPES.items():
        if not recipe.fsdp:
            continue  # install() decides those itself
        use = asked(cfg, name)
        if use == "off" or not applies(name, cfg, shard_ranks, reduce_dtype):
            verdicts[name] = Verdict(False)
        elif name == "cast_in_step" and not verdicts["one_rank_copies"].on:
            verdicts[name] = Verdict(False)  # it casts into what the direct unshard keeps
        elif use == "auto" and device_type != "cuda":
            verdicts[name] = Verdict(False)  # measured on GPUs: a CPU run keeps torch's path
        elif recipe.native():
            verdicts[name] = Verdict(True)  # torch's own in the recipe's place (FSDP2's set_keep_unsharded_storage)
        else:
            why = recipe.why_not(force)
            verdicts[name] = Verdict(why is None, None if why is None else recipe.off_line(why))
    return verdicts


def refusal(cfg: DictConfig) -> str | None:
    """The one line that refuses this run's speed settings before any rank starts; None where they can run."""
    speed, strategy = cfg.speed, cfg.sharding.strategy
    for name, recipe in RECIPES.items():
        if not recipe.fsdp or asked(cfg, name) != "on":
            continue  # the model's own levers: their refusals follow
        if strategy not in FSDP_STRATEGIES:
            return (f"speed.{name}={'true' if recipe.switch else 'on'} {recipe.does}, and sharding={cfg.sharding.name} "
                    f"does not use FSDP2; use sharding=fsdp2 or hsdp, or drop the override")
        if recipe.native():
            continue
        line = recipe.refusal(bool(speed.force_unverified))
        if line:
            return line
    if asked(cfg, "norm_in_copy_in") == "on":
        for needed in ("reduce_copy_in", "one_rank_copies"):
            if asked(cfg, needed) == "off":
                return (f"speed.norm_in_copy_in=on sums the gradient norm in speed.reduce_copy_in's kernel where speed.one_rank_copies "
                        f"makes its output the gradients, and speed.{needed}=off; set speed.{needed}=auto or on")
        if cfg.optim.grad_clip <= 0:
            return ("speed.norm_in_copy_in=on gives clipping its norm, and optim.grad_clip=0 clips nothing; "
                    "set optim.grad_clip > 0 or speed.norm_in_copy_in=off")
    if asked(cfg, "tied_embedding_grad") == "on" and not cfg.model.get("tie_embeddings", False):
        return (f"speed.tied_embedding_grad=on adds a tied embedding's gradient into the head's, and model={cfg.model.name} does not tie "
                "them (model.tie_embeddings=false); set model.tie_embeddings=true or drop the override")
    if asked(cfg, "cast_in_step") == "on":
        if asked(cfg, "one_rank_copies") == "off":
            return ("speed.cast_in_step=on writes the casts into the storage speed.one_rank_copies keeps, and speed.one_rank_copies=off; "
                    "set speed.one_rank_copies=auto or on")
        if str(cfg.optim.impl) != "triton":
            return f"speed.cast_in_step=on is done by the Triton AdamW update, and optim.impl={cfg.optim.impl}; set optim.impl=triton"
    return None


def install_fsdp(model: nn.Module, verdicts: dict[str, Verdict], param_dtype: str, main: bool) -> list[str]:
    """Each recipe's replacement in place (or torch's own back) for a model FSDP2 has just sharded;
    cast_in_step is the Trainer's, once the optimizer exists. Returns the names of the recipes that run."""
    from src.speed import grad_upcast, one_rank, reduce_copy_in

    for verdict in verdicts.values():
        if main and verdict.warning:
            log.warning(verdict.warning)
    running = []
    for name, module in (("grad_upcast", grad_upcast), ("reduce_copy_in", reduce_copy_in)):
        if not verdicts[name].on:
            module.restore()
        elif module.install():
            running.append(name)
        elif main:
            log.warning("speed.%s: not installed (Triton is missing, or other code has replaced %s); torch's own path instead",
                        name, ", ".join(s.rpartition(":")[2] for s in RECIPES[name].replaces))
    if verdicts["one_rank_copies"].on:
        if one_rank.use_direct_unshard():
            running.append("one_rank_copies")
        elif main:
            log.warning("speed.one_rank_copies: the direct unshard not installed (other code has replaced FSDPParamGroup.wait_for_unshard "
                        "or FSDPParam.all_gather_inputs); FSDP2 casts and copies as usual")
        aliased = one_rank.alias_one_rank_reduces(model)
        if main:
            log.info("speed.one_rank_copies: %d one-rank FSDP2 groups reduce with no copy of their gradients", aliased)
    else:
        one_rank.restore_unshard()
    if verdicts["keep_unsharded"].on:
        n, nbytes = keep_unsharded.keep_unsharded(model, torch_dtype(param_dtype))
        if n:
            running.append("keep_unsharded")
            if main:
                size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
                how = "FSDP2's own set_keep_unsharded_storage" if keep_unsharded.public() else "the recipe"
                log.info("speed.keep_unsharded: %d parameters gathered into the same memory every step (%s a rank, %s); "
                         "no unit reshards after forward", n, size, how)
        elif main:
            log.warning("speed.keep_unsharded: nothing kept (other code replaced FSDPParam.free_unsharded_param); FSDP2 frees and gathers as usual")
    if main and running:
        log.info("speed recipes in place: %s (src/speed/; python -m src.speed lists them)", ", ".join(running))
    return running


def install(cfg: DictConfig, model: nn.Module, device: torch.device, main: bool, mesh: DeviceMesh | None = None,
            shard: Callable[[str], None] | None = None) -> list[str]:
    """Every speed lever of this run in place, each where it must go: the tied embedding's class swap
    before sharding; then, with a device mesh (fsdp2, hsdp), the recipes' verdicts, `shard(reduce_dtype)`
    (FSDP2's fully_shard, in the reduce dtype those verdicts allow), FSDP2's recipes and clipping's norm
    from the copy-in. Returns the levers that run; cast_in_step's is the Trainer's to install, once the
    optimizer exists."""
    from src.speed.grad_squares import SQUARES
    from src.speed.tied_embedding import tie_embedding_gradient

    running = ["tied_embedding_grad"] if tie_embedding_gradient(cfg, model, device, main) else []
    SQUARES.reset()  # a run before this one in the process may have left the copy-in summing (set below where it applies)
    if mesh is None:
        return running
    shard_ranks = mesh.size(mesh.ndim - 1)  # the shard dimension: the mesh's last (src/distributed/env.py)
    direct = decide(cfg, shard_ranks, device.type, str(cfg.precision.reduce_dtype))["one_rank_copies"].on
    reduce_dtype = _reduce_dtype(cfg, mesh, direct, main)
    verdicts = decide(cfg, shard_ranks, device.type, reduce_dtype)
    if shard is not None:
        shard(reduce_dtype)
    running += install_fsdp(model, verdicts, cfg.precision.param_dtype, main)
    if norm_in_copy_in(cfg, running, mesh.size(), main, model):
        running.append("norm_in_copy_in")  # taken by the Trainer's clipping (src/speed/grad_squares.py)
    if verdicts["cast_in_step"].on:
        running.append("cast_in_step")  # installed by the Trainer, once the optimizer exists
    return running


def _reduce_dtype(cfg: DictConfig, mesh: DeviceMesh, direct: bool, main: bool) -> str:
    """precision.reduce_dtype, but float32 where one rank is the whole mesh, FSDP2's one-rank copies are
    dropped (`direct`: speed.one_rank_copies runs) and the gradients would be "reduced" in the dtype they
    are computed in (reduce_dtype = param_dtype, below the fp32 parameters'). One rank reduces nothing:
    FSDP2 copies the bf16 gradients into a bf16 buffer, then casts that to fp32 for the parameters, 10
    bytes a parameter; cast straight into an fp32 buffer, which is then the fp32 gradient, it is 6, for
    the same bits (every bf16 value is an fp32 one)."""
    reduce_dtype = str(cfg.precision.reduce_dtype)
    if (mesh.size() == 1 and direct and not cfg.sharding.cpu_offload
            and reduce_dtype == str(cfg.precision.param_dtype) and torch_dtype(reduce_dtype) != torch.float32):
        if main:
            log.info("precision.reduce_dtype=%s: one rank reduces nothing, so its %s gradients are cast straight into the "
                     "fp32 gradient buffer (the same bits, 4 bytes a parameter fewer)", reduce_dtype, reduce_dtype)
        return "float32"
    return reduce_dtype


def norm_in_copy_in(cfg: DictConfig, speed_on: list[str], mesh_ranks: int, main: bool, model: nn.Module | None = None) -> bool:
    """speed.norm_in_copy_in: on (and the copy-in summing squares from now on) where one rank is the whole mesh,
    the copy-in and one-rank recipes run and clipping reads the norm; off, and the copy-in summing nothing,
    everywhere else (one process may run several)."""
    from src.speed.grad_squares import SQUARES, divides_gradients

    wanted = asked(cfg, "norm_in_copy_in") != "off" and cfg.optim.grad_clip > 0
    SQUARES.on = (wanted and mesh_ranks == 1 and {"reduce_copy_in", "one_rank_copies"} <= set(speed_on)
                  and not (model is not None and divides_gradients(model)))
    if asked(cfg, "norm_in_copy_in") == "on" and not SQUARES.on and main:  # auto where it does not apply: off without a word
        log.info("speed.norm_in_copy_in: off in this run (it needs one rank, speed.reduce_copy_in and one_rank_copies running, and no "
                 "gradient divide factor); clipping sums the norm in a pass of its own")
    return SQUARES.on
