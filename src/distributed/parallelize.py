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

import contextlib
import logging
import os
import zlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
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
    symm_mem: bool = False,
    forward_prefetch: int = 0,
    backward_prefetch: int = 0,
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
    if forward_prefetch or backward_prefetch:
        set_prefetch(model, forward_prefetch, backward_prefetch)
    if symm_mem:
        from src.distributed.symm_mem import use_symm_mem

        route = use_symm_mem(model, mesh)
        if not dist.is_initialized() or dist.get_rank() == 0:
            log.info("sharding.symm_mem: all-gathers into NCCL symmetric memory (%s)",
                     "FSDP2's set_symm_mem_for_comm" if route == "fsdp2" else "a custom FSDP2 all-gather over the symmetric-memory pool")
    return model


def forward_units(model: nn.Module) -> list[FSDPModule]:
    """The FSDP units under the root, in the order forward gathers them: the embedding (split
    root), the blocks, the head (split root, unless it computes the fused loss)."""
    order = [getattr(model, "embed", None), *model.layers, getattr(model, "head", None)]
    return [m for m in order if isinstance(m, FSDPModule) and m is not model]


def prefetch_plan(order: list, k: int) -> list[tuple[object, list]]:
    """(unit, the k units after it) for each unit that has any: the explicit prefetch list."""
    return [(unit, order[i + 1 : i + 1 + k]) for i, unit in enumerate(order) if order[i + 1 : i + 1 + k]]


def set_prefetch(model: FSDPModule, forward: int, backward: int) -> None:
    """Explicit all-gather prefetching. Forward: the root's hook issues the first k units' gathers
    and each unit the next k, so a gather is queued a unit's compute ahead of its use even when
    the host queues forward no faster than the GPUs run it (the tuned 2-H200 step: 2 ms of host
    a block against 1.6-2 ms of kernels, the gathers 0.3-0.5 ms each exposed). Backward: each
    unit issues the gathers of the k units that backward reaches next (FSDP2 prefetches one)."""
    units = forward_units(model)
    if forward:
        for unit, nxt in prefetch_plan([model, *units], forward):
            unit.set_modules_to_forward_prefetch(nxt)
    if backward:
        for unit, nxt in prefetch_plan(units[::-1], backward):
            unit.set_modules_to_backward_prefetch(nxt)


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


STATIC_LAUNCH_ENV = "TORCHINDUCTOR_STATIC_LAUNCH_USER_DEFINED_TRITON_KERNELS"


@contextlib.contextmanager
def inductor_config(cfg):
    """Inductor settings for a whole training run: kernels.cpp_wrapper's C++ launch code,
    kernels.static_launch's static launcher for user-defined Triton kernels, kernels.cudagraphs' CUDA
    graphs and kernels.max_autotune's GEMM autotuning. Set for the run, not passed to
    torch.compile(options=...): each block's backward graph is compiled lazily at the first
    backward, after compile's own options have been restored, and on torch 2.11 cpp_wrapper then
    fails there ("CudaKernelParamCache not populated", pytorch/pytorch#178845, fixed in 2.12)."""
    import torch._inductor.config as inductor

    settings = {}
    static = False
    if cfg.kernels.cpp_wrapper:
        settings["cpp_wrapper"] = True
    elif cfg.kernels.static_launch:
        if hasattr(inductor, "static_launch_user_defined_triton_kernels"):  # torch 2.8+
            settings["static_launch_user_defined_triton_kernels"] = static = True
        else:
            log.warning("kernels.static_launch: this torch's Inductor cannot launch user-defined Triton kernels statically; they keep Triton's launcher")
    if cfg.kernels.cudagraphs:
        settings["triton.cudagraphs"] = True
        # code compiled earlier in this process (a sweep's job without graphs) would be reused as it is
        release_cuda_graphs()
    if cfg.kernels.max_autotune:
        settings["max_autotune"] = True
        if hasattr(inductor.triton, "enable_persistent_tma_matmul"):  # Hopper's TMA templates among the candidates
            settings["triton.enable_persistent_tma_matmul"] = True
    with contextlib.ExitStack() as stack:
        if static:
            stack.enter_context(_compile_workers_static_launch())
        if settings:
            stack.enter_context(inductor.patch(settings))
        yield


def cudagraph_skips() -> int:
    """Compiled graphs Inductor ran without a CUDA graph so far in this process (kernels.cudagraphs:
    a mutated input, a CPU tensor, too many re-recordings; each reason is logged as it happens)."""
    from torch._dynamo.utils import counters

    return counters["inductor"]["cudagraph_skips"]


def cudagraph_counts(device: torch.device) -> dict[str, int]:
    """kernels.cudagraphs on `device`: the CUDA graphs the trees hold (`graphs`: one a compiled block's
    forward or backward at each place in the step, 24 a step for mini_llm's 12 blocks) and how often
    one was recorded again because an input it reads in place (a weight) had moved (`rerecords`:
    under FSDP2 with more than one rank, gathered weights land in new memory unless the allocator
    hands the same blocks back)."""
    from torch._inductor.cudagraph_trees import get_manager

    manager = get_manager(device.index if device.index is not None else torch.cuda.current_device(), create_if_none_exists=False)
    if manager is None or manager.roots is None:
        return {"graphs": 0, "rerecords": 0}
    graphs, nodes = 0, [node for roots in manager.roots.values() for node in roots]
    while nodes:
        node = nodes.pop()
        graphs += 1
        nodes.extend(child for children in node.children.values() for child in children)
    return {"graphs": graphs, "rerecords": sum(n for per_node in manager.num_rerecord.values() for n in per_node.values())}


def release_cuda_graphs() -> None:
    """Free kernels.cudagraphs' graphs and their memory pool, and Dynamo's compiled code with them: a
    compiled block keeps the trees it was first run under, so the next run in this process (an
    in-process sweep's job) compiles afresh, under its own kernels settings, instead of calling
    graphs that are gone. Run before the process group goes (torchtitan releases its graphs there,
    pytorch/torchtitan#2050; these graphs hold no collective, FSDP2's hooks run outside them)."""
    import torch._dynamo

    torch._dynamo.reset()  # the trees too (reset_cudagraph_trees)


@contextlib.contextmanager
def _compile_workers_static_launch():
    """Inductor's compile workers decide whether a kernel launches statically, and read that from
    their environment when they start: torch 2.11 hands them use_static_triton_launcher alone, not
    the parent's static_launch_user_defined_triton_kernels. So the variable is set for the run, and
    the process's worker pool (one a process, kept between runs: a sweep's in-process jobs share
    it) is shut down on the way in and out, so that this run's workers start with it and the next
    run's without it."""
    from torch._inductor.async_compile import shutdown_compile_workers

    before = os.environ.get(STATIC_LAUNCH_ENV)
    shutdown_compile_workers()
    os.environ[STATIC_LAUNCH_ENV] = "1"
    try:
        yield
    finally:
        shutdown_compile_workers()
        if before is None:
            os.environ.pop(STATIC_LAUNCH_ENV, None)
        else:
            os.environ[STATIC_LAUNCH_ENV] = before


def _route(setting: str, wanted: bool, use, restore, main: bool, routed: str | None, missing: str) -> bool:
    """One of FSDP2's copies through this project's replacement (`use()`) or FSDP2's own
    (`restore()`); the main rank says which where it matters (`routed`, None: nothing to say) and
    warns where the replacement could not be installed. Whether the replacement is in place."""
    if not wanted:
        restore()
        return False
    if use():
        if main and routed:
            log.info("%s: %s", setting, routed)
        return True
    if main:
        log.warning("%s: %s", setting, missing)
    return False


def _grad_upcast(choice: str, reduce_dtype: str, device: torch.device, main: bool) -> None:
    """sharding.grad_upcast: which kernel upcasts FSDP2's reduced gradients to the fp32 parameters'
    dtype. Only a bf16/fp16 reduce on CUDA has such a cast; anything else leaves FSDP2 as it is."""
    from src.distributed.grad_cast import restore_grad_upcast, use_triton_grad_upcast

    _route("sharding.grad_upcast=triton", choice == "triton" and device.type == "cuda" and torch_dtype(reduce_dtype) != torch.float32,
           use_triton_grad_upcast, restore_grad_upcast, main,
           f"FSDP2's reduced {reduce_dtype} gradients upcast to fp32 by kernels/triton/cast.py",
           "FSDP2's cast not routed (this torch has no _fsdp_collectives._to_dtype_if_needed, Triton is missing, "
           "or other code replaced the function); torch's .to() upcasts")


def _gather_copy_in(choice: str, param_dtype: str, ranks: int, main: bool) -> None:
    """sharding.gather_copy_in: one pass (cast into the all-gather buffer) or FSDP2's two. Groups
    without a lower param_dtype take FSDP2's own path either way, and one rank gathers nothing
    (src/distributed/copy_in.py); the log says so only where the one pass runs."""
    from src.distributed.copy_in import restore_copy_in, use_one_pass_copy_in

    runs = torch_dtype(param_dtype) != torch.float32 and ranks > 1
    _route("sharding.gather_copy_in=one_pass", choice == "one_pass", use_one_pass_copy_in, restore_copy_in, main,
           f"fp32 shards cast to {param_dtype} straight into FSDP2's all-gather buffer" if runs else None,
           "FSDP2's copy-in left as it is (this torch's _fsdp_collectives lacks _get_param_all_gather_inputs or "
           "_get_all_gather_input_metadatas, or other code replaced them)")


def _reduce_copy_in(choice: str, reduce_dtype: str, device: torch.device, main: bool) -> None:
    """sharding.reduce_copy_in: which kernel copies FSDP2's unsharded gradients into the
    reduce-scatter input; the Triton kernel runs on CUDA only (src/distributed/reduce_copy_in.py)."""
    from src.distributed.reduce_copy_in import restore_reduce_copy_in, use_triton_reduce_copy_in

    _route("sharding.reduce_copy_in=triton", choice == "triton" and device.type == "cuda",
           use_triton_reduce_copy_in, restore_reduce_copy_in, main,
           f"FSDP2's gradients copied into the {reduce_dtype} reduce-scatter input by kernels/triton/chunk_cat.py",
           "FSDP2's copy-in not routed (this torch has no _fsdp_collectives.foreach_reduce_scatter_copy_in, "
           "Triton is missing, or other code replaced the function); torch._chunk_cat copies")


def _one_rank_copies(choice: str, model: nn.Module, mesh: DeviceMesh, param_dtype: str, cpu_offload: bool, main: bool) -> None:
    """sharding.one_rank_copies: on a one-rank shard group, unshard by one cast into the unsharded
    parameters and reduce with no copy (direct), or FSDP2's cast-and-copy and copy (fsdp2). Both
    are installed only where the shard group has one rank (src/distributed/one_rank.py); the
    reduce comm is set per group, on plain FSDP groups that still have FSDP2's default comm."""
    from src.distributed.one_rank import alias_one_rank_reduces, restore_unshard, use_direct_unshard

    one_rank = mesh.size(mesh.ndim - 1) == 1  # the shard dimension: the mesh's last (env.py)
    wanted = choice == "direct" and one_rank
    unshard = _route("sharding.one_rank_copies=direct", wanted, use_direct_unshard, restore_unshard, main, None,
                     "FSDP2's one-rank unshard left as it is (this torch's FSDP2 lacks FSDPParamGroup.wait_for_unshard or "
                     "FSDPParam.all_gather_inputs, or other code replaced them)")
    if wanted:
        n = alias_one_rank_reduces(model)
        if main:
            cast = (f"each unshard casts the fp32 shards straight into the unsharded {param_dtype} parameters, "
                    if unshard and not cpu_offload and torch_dtype(param_dtype) != torch.float32 else "")
            log.info("sharding.one_rank_copies=direct: one rank: %s%d FSDP2 groups reduce with no copy of their gradients", cast, n)


def _reduce_dtype(cfg: DictConfig, mesh: DeviceMesh, main: bool) -> str:
    """precision.reduce_dtype, but float32 where one rank is the whole mesh (sharding.one_rank_copies=direct, no
    CPU offload) and the gradients would be "reduced" in the dtype they are computed in (reduce_dtype = param_dtype,
    below the fp32 parameters'). One rank reduces nothing: FSDP2 copies the bf16 gradients into a bf16 buffer,
    then casts that to fp32 for the parameters, 10 bytes a parameter; cast straight into an fp32 buffer, which is
    then the fp32 gradient, it is 6, for the same bits (every bf16 value is an fp32 one). On +exp=fsdp4_fp8 on one
    H200: 0.13 GB less peak, the step level to 0.9 ms faster (docs/PERFORMANCE.md 7)."""
    reduce_dtype = str(cfg.precision.reduce_dtype)
    if (mesh.size() == 1 and cfg.sharding.one_rank_copies == "direct" and not cfg.sharding.cpu_offload
            and reduce_dtype == str(cfg.precision.param_dtype) and torch_dtype(reduce_dtype) != torch.float32):
        if main:
            log.info("precision.reduce_dtype=%s: one rank reduces nothing, so its %s gradients are cast straight into the "
                     "fp32 gradient buffer (the same bits, 4 bytes a parameter fewer)", reduce_dtype, reduce_dtype)
        return "float32"
    return reduce_dtype


def _keep_unsharded(model: nn.Module, param_dtype: str, main: bool) -> None:
    """sharding.keep_unsharded: FSDP2's unsharded parameters never freed (src/distributed/kept_unshard.py)."""
    from src.distributed.kept_unshard import keep_unsharded

    n, nbytes = keep_unsharded(model, torch_dtype(param_dtype))
    if not main:
        return
    if n:
        size = f"{nbytes / 1e9:.2f} GB" if nbytes >= 1e8 else f"{nbytes / 1e6:.1f} MB"
        log.info("sharding.keep_unsharded: %d parameters gathered into the same memory every step (%s a rank); "
                 "no unit reshards after forward", n, size)
    else:
        log.warning("sharding.keep_unsharded: nothing kept (this torch's FSDPParam has no free_unsharded_param, or other code "
                    "replaced it); FSDP2 frees and gathers as usual")


def parallelize(model: nn.Module, cfg: DictConfig, mesh: DeviceMesh | None, device: torch.device) -> Parallelized:
    """float8 -> NVTX ranges -> compile -> fully_shard (mesh given: fsdp2, hsdp) or DDP -> init.

    `mesh` is None for sharding=none. Fused-kernel swaps (src/fusion/) come before this: they keep
    every Parameter, so what is sharded is the same either way."""
    strategy = cfg.sharding.strategy
    main = not dist.is_initialized() or dist.get_rank() == 0
    after_optimizer = None
    if cfg.precision.float8:  # torchtitan's order: float8 swap, then compile, then fully_shard
        from src.distributed.float8 import act_in_cast, convert_blocks_to_float8, gathers_float8, scale_precompute

        gather_fp8 = gathers_float8(cfg.precision, strategy)
        impl = str(cfg.precision.fp8_impl)
        fold = act_in_cast(cfg.precision, cfg.model.mlp)
        n_fp8 = convert_blocks_to_float8(model, cfg.precision.fp8_recipe, gather_fp8, impl=impl, fold_activation=fold)
        after_optimizer = scale_precompute(model) if gather_fp8 else None
        if main:
            log.info("float8 (%s scales, %s casts): %d block linears, weights all-gathered in %s%s", cfg.precision.fp8_recipe, impl, n_fp8,
                     "float8" if gather_fp8 else "bf16", ", the MLPs' SiLU inside the down projections' casts" if fold else "")
    if cfg.profile.nvtx:
        from src.profiling.annotate import module_ranges

        module_ranges(model)  # before compile and sharding: hooks on the plain modules
    if cfg.kernels.compile:
        # in place (nn.Module.compile), so parameter names and checkpoints stay those of eager;
        # torchtitan wraps instead (torch.compile(block)): the same graph, one per block
        # kernels.cpp_wrapper is Inductor config for the whole run (inductor_config below), not a
        # per-compile option: a block's backward graph is compiled lazily, after the option is gone
        for block in model.layers:
            block.compile(backend=cfg.kernels.compile_backend)

    autocast_dtype = None
    if mesh is not None:
        reduce_dtype = _reduce_dtype(cfg, mesh, main)
        apply_fsdp(
            model, mesh, mixed_precision_policy(cfg.precision.param_dtype, reduce_dtype),
            cfg.sharding.reshard_after_forward, cfg.sharding.cpu_offload, cfg.sharding.split_root, cfg.sharding.symm_mem,
            cfg.sharding.forward_prefetch, cfg.sharding.backward_prefetch,
        )
        _grad_upcast(cfg.sharding.grad_upcast, reduce_dtype, device, main)
        _gather_copy_in(cfg.sharding.gather_copy_in, cfg.precision.param_dtype, mesh.size(), main)
        _reduce_copy_in(cfg.sharding.reduce_copy_in, reduce_dtype, device, main)
        _one_rank_copies(cfg.sharding.one_rank_copies, model, mesh, cfg.precision.param_dtype, cfg.sharding.cpu_offload, main)
        if cfg.sharding.keep_unsharded:
            _keep_unsharded(model, cfg.precision.param_dtype, main)
    elif torch_dtype(cfg.precision.param_dtype) != torch.float32:
        autocast_dtype = torch_dtype(cfg.precision.param_dtype)  # unsharded mixed precision: fp32 weights, autocast compute
    materialize_and_init(model, torch.device("cpu") if cfg.sharding.cpu_offload else device, cfg.train.seed)
    if mesh is None and dist.is_initialized() and dist.get_world_size() > 1:
        model = DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    return Parallelized(model, autocast_dtype, after_optimizer)
