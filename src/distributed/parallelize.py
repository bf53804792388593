"""How the model is laid on the devices: one `parallelize(model, cfg, mesh, device)`, in order.

torchtitan's parallelize_llama order, on the plain model built on the meta device: float8 swap of
the blocks' linears, NVTX ranges on the plain modules (profile.nvtx), torch.compile per block,
then the sharding strategy, then materialisation. fsdp2 / hsdp: `fully_shard` on each transformer
block, then on the root, over an explicit mesh (the root's group then holds only the embedding and
head; `sharding.split_root` gives those two units of their own). none: the full model on every
rank, gradients all-reduced by DDP when there is more than one rank; a non-fp32 param_dtype then
means autocast over fp32 weights.
"""
from __future__ import annotations

import logging
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.distributed.tensor import DTensor, distribute_tensor
from torch.nn.parallel import DistributedDataParallel

from src.dtypes import torch_dtype


def mixed_precision_policy(param_dtype: str, reduce_dtype: str) -> MixedPrecisionPolicy:
    return MixedPrecisionPolicy(param_dtype=torch_dtype(param_dtype), reduce_dtype=torch_dtype(reduce_dtype))


def apply_fsdp(
    model: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    reshard_after_forward: bool = True,
    cpu_offload: bool = False,
    split_root: bool = False,
) -> nn.Module:
    """Per-block fully_shard, then the root. Each block's parameters are all-gathered just before its
    forward and freed after it (reshard_after_forward), so peak memory holds one full block at a time.

    `split_root`: the embedding, and the head unless it computes the fused loss, become units of
    their own first (torchtitan's layout). In the seed's layout the root's one group holds both,
    so the head's gradient, the first one backward computes, waits for the embedding's, the last,
    and the two are reduce-scattered together after all the blocks (131M parameters in fp32 for
    mini_llm, nothing left to hide behind); split, the head's reduction runs beside the blocks'
    backward and only the embedding's is left at the end.
    """
    offload: OffloadPolicy = CPUOffloadPolicy() if cpu_offload else OffloadPolicy()
    if split_root:
        embed, head = getattr(model, "embed", None), getattr(model, "head", None)
        if isinstance(embed, nn.Module):
            fully_shard(embed, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, offload_policy=offload)
        # A fused head + loss is called as head.loss(...), not head(...): FSDP2's hooks would not
        # gather its weight, so it stays in the root's group, whose hooks wrap the whole forward.
        if isinstance(head, nn.Module) and getattr(head, "loss", None) is None:
            # backward starts with the head: keeping it gathered saves one all-gather for nothing
            fully_shard(head, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    for block in model.layers:
        fully_shard(block, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=reshard_after_forward, offload_policy=offload)
    # The root's parameters (embedding, head) are needed again at the start of backward: keeping
    # them gathered after forward saves one all-gather of the largest matrices for free memory.
    fully_shard(model, mesh=mesh, mp_policy=mp_policy, reshard_after_forward=False, offload_policy=offload)
    return model


def _full_init_tensor(kind: str, std: float, shape: torch.Size, seed: int, name: str, device: torch.device) -> torch.Tensor:
    if kind == "ones":
        return torch.ones(shape, device=device)
    if kind == "zeros":
        return torch.zeros(shape, device=device)
    # One generator per parameter, seeded by the run seed and the parameter's name: the full
    # tensor is the same on every rank and for every world size, whatever order params come in.
    gen = torch.Generator(device=device).manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape, device=device).normal_(0.0, std, generator=gen)


@torch.no_grad()
def materialize_and_init(model: nn.Module, device: torch.device, seed: int) -> nn.Module:
    """Allocate a meta-device (possibly sharded) model on `device` and fill it deterministically.

    For a DTensor parameter each rank draws the full tensor and keeps its own shard
    (distribute_tensor with src_data_rank=None slices locally, no communication).
    """
    model.to_empty(device=device)
    tie = getattr(model, "tie_weights", None)  # a shared weight (a tied head) becomes two tensors in to_empty
    if tie is not None:
        tie()
    for name, param in model.named_parameters():
        name = name.replace("_orig_mod.", "").replace("_fsdp_wrapped_module.", "")
        kind, std = model.param_init(name)
        if isinstance(param, DTensor):
            full = _full_init_tensor(kind, std, param.shape, seed, name, param.to_local().device)
            shard = distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
            param.to_local().copy_(shard.to_local())
        else:
            param.copy_(_full_init_tensor(kind, std, param.shape, seed, name, param.device))
    return model


log = logging.getLogger("src.train")


@dataclass
class Parallelized:
    model: nn.Module
    """the sharded (or DDP-wrapped) model, materialised and initialised"""
    autocast_dtype: torch.dtype | None = None
    """unsharded mixed precision: the compute dtype autocast runs in over fp32 weights"""
    after_optimizer: Callable[[], None] | None = None
    """float8 all-gather: the next step's weight scales, after each optimizer step"""
    speed: list[str] = field(default_factory=list)
    """the speed recipes this run's model runs with (src/speed/); cast_in_step's once the optimizer exists"""


def parallelize(model: nn.Module, cfg: DictConfig, mesh: DeviceMesh | None, device: torch.device) -> Parallelized:
    """float8 -> NVTX ranges -> compile -> fully_shard (mesh given: fsdp2, hsdp) or DDP -> init.

    `mesh` is None for sharding=none. Fused-kernel swaps (src/fusion/) come before this: they keep
    every Parameter, so what is sharded is the same either way."""
    strategy = cfg.sharding.strategy
    main = not dist.is_initialized() or dist.get_rank() == 0
    after_optimizer = None
    if cfg.precision.float8:  # torchtitan's order: float8 swap, then compile, then fully_shard
        from src.distributed.float8 import (
            act_in_cast,
            convert_blocks_to_float8,
            float8_head,
            gathers_float8,
            scale_precompute,
        )

        gather_fp8 = gathers_float8(cfg.precision, strategy)
        impl = str(cfg.precision.fp8_impl)
        fold = act_in_cast(cfg.precision, cfg.model.mlp)
        n_fp8 = convert_blocks_to_float8(model, cfg.precision.fp8_recipe, gather_fp8, impl=impl, fold_activation=fold,
                                         fast_accum=bool(cfg.precision.fp8_fast_accum))
        after_optimizer = scale_precompute(model) if gather_fp8 else None
        if cfg.precision.fp8_head and not float8_head(model):
            raise ValueError("precision.fp8_head=true: the model's head is not the fused linear + cross-entropy (kernels.fused=[linear_cross_entropy])")
        if main:
            log.info("float8 (%s scales, %s casts%s): %d block linears%s, weights all-gathered in %s%s", cfg.precision.fp8_recipe, impl,
                     ", fast accumulation in every GEMM" if cfg.precision.fp8_fast_accum else "", n_fp8,
                     " and the head's logits GEMM" if cfg.precision.fp8_head else "",
                     "float8" if gather_fp8 else "bf16", "" if not fold else ", the MLPs' SiLU inside the down projections' casts"
                     if str(cfg.model.mlp) == "silu" else ", each SwiGLU MLP one float8 function (fp8_swiglu)")
    if cfg.ac.mode != "none":  # torchtitan's order: float8, activation checkpointing, compile, FSDP2
        from src.distributed.activation_checkpoint import apply_activation_checkpointing

        n_ac = apply_activation_checkpointing(model, str(cfg.ac.mode), str(cfg.ac.selective))
        if main:
            log.info("activation checkpointing (%s%s): %d of %d blocks", cfg.ac.mode, f", {cfg.ac.selective}" if cfg.ac.mode == "selective" else "",
                     n_ac, len(model.layers))
    if cfg.profile.nvtx:
        from src.profiling.annotate import module_ranges

        module_ranges(model)  # before compile and sharding: hooks on the plain modules
    if cfg.kernels.compile:
        # in place (nn.Module.compile), so parameter names and checkpoints stay those of eager;
        # torchtitan wraps instead (torch.compile(block)): the same graph, one per block
        # Inductor options the run needs (speed.cudagraphs) are set for the whole run, not per compile:
        # a block's backward graph is compiled lazily, after a per-compile option is gone (src/speed/inductor.py)
        for block in model.layers:
            block.compile(backend=cfg.kernels.compile_backend)

    autocast_dtype = None
    from src.speed import install

    def shard(reduce_dtype: str) -> None:
        apply_fsdp(model, mesh, mixed_precision_policy(cfg.precision.param_dtype, reduce_dtype),
                   cfg.sharding.reshard_after_forward, cfg.sharding.cpu_offload, cfg.sharding.split_root)

    speed_on = install(cfg, model, device, main, mesh, shard)  # every speed lever, fully_shard in its place among them
    if mesh is None and torch_dtype(cfg.precision.param_dtype) != torch.float32:
        autocast_dtype = torch_dtype(cfg.precision.param_dtype)  # unsharded mixed precision: fp32 weights, autocast compute
    materialize_and_init(model, torch.device("cpu") if cfg.sharding.cpu_offload else device, cfg.train.seed)
    if cfg.model.hf_path:  # each rank reads only the rows of its own shards
        from src.models import architecture

        n = architecture(cfg.model.arch).hf.load(model, cfg.model.hf_path)
        if main:
            log.info("model.hf_path: %d parameters read from %s", n, cfg.model.hf_path)
    if mesh is None and dist.is_initialized() and dist.get_world_size() > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return Parallelized(model, autocast_dtype, after_optimizer, speed_on)
