"""FSDP2 on a one-rank shard group without its stand-in copies (`sharding.one_rank_copies=direct`).

With one rank FSDP2 gathers and reduce-scatters nothing, but it still copies as if it did:

- unshard (`FSDPParamGroup.wait_for_unshard`): each fp32 shard is cast to param_dtype into a new
  tensor (`FSDPParam.all_gather_inputs`), then copied into the unsharded parameter's storage: read
  4 + write 2, then read 2 + write 2 bytes a parameter, on the compute stream, at every unshard
  (twice a step with reshard_after_forward). Cast straight into that storage: 6 bytes.
- reduce (`foreach_reduce`): the unit's gradients, already copied into the reduce-scatter input,
  are copied again into a reduce output of the same size (`reduce_output.copy_(reduce_scatter_input)`):
  8 bytes a parameter with the seed's fp32 reduce, on the reduce stream beside backward's GEMMs.
  Here the output is the input (a custom reduce-scatter comm of FSDP2's `ReduceScatter` interface,
  whose second buffer is its first, recorded on the reduce stream), and the copy is a no-op. Plain
  FSDP groups only: HSDP's all-reduce and an all-reduce hook read the output on another stream.

For mini_llm on one H200 these are the profile's 207 DtoD memcpys, 2.8 ms a step of the seed's
eager step (docs/PERFORMANCE.md 7's one-GPU anatomy). The parameters and gradients are the same
bits: the cast is the same fp32 -> bf16 copy (round to nearest even), and the gradients are read
from the buffer they were copied into rather than a copy of it.

The unshard has no hook, so the method is wrapped: before FSDP2's own runs, each parameter it will
cast is cast into its unsharded storage, and `all_gather_inputs` hands FSDP2 that storage, so its
copy is of a tensor onto itself, which torch returns from at once. Groups this does not cover
(more than one rank, no lower param_dtype, CPU offload, tensor subclasses with their own
`fsdp_pre_all_gather` such as float8 weights, parameters kept sharded after forward) and anything
traced under torch.compile run FSDP2's path unchanged. Process-wide; where this torch's FSDP2 lacks
the method or the property, nothing changes and `use_direct_unshard` says so.
"""
from __future__ import annotations

import torch
import torch.nn as nn
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter
from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam, ShardedState, alloc_storage
from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

from src.distributed.fsdp_patch import CollectivesPatch

_DIRECT = "_direct_all_gather_input"  # an FSDPParam's unsharded storage, already cast, for FSDP2's copy


def _one_rank(group) -> bool:
    # FSDP2's own test for its one-rank unshard path (a replicate-only group is left to it)
    return isinstance(group.mesh_info, _fsdp_common.FSDPMeshInfo) and group._all_gather_process_group.size() == 1


def _castable(fsdp_param) -> bool:
    dtype = fsdp_param.param_dtype
    return (dtype is not None and dtype != fsdp_param._sharded_param_data.dtype and not fsdp_param.offload_to_cpu
            and fsdp_param.sharded_state == ShardedState.SHARDED
            and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"))


@torch.no_grad()
def _cast_into_unsharded(group, marked: list) -> None:
    """Cast each castable parameter of a one-rank group straight into its unsharded storage (the
    buffer FSDP2's copy would write) and mark it for `all_gather_inputs`, appending it to `marked`
    as it goes (the caller unmarks them whatever happens)."""
    if torch.compiler.is_compiling() or not group._all_gather_result or not _one_rank(group):
        return
    for p in group.fsdp_params:
        if not _castable(p):
            continue
        shard = p._sharded_param_data
        p.init_all_gather_outputs([shard.numel()], [p.param_dtype], 1, group.device)
        out = p.all_gather_outputs[0]
        alloc_storage(out)
        with torch.autograd._unsafe_preserve_version_counter(out):
            out.copy_(shard)
        marked.append(p)
        p.__dict__[_DIRECT] = out


def _wait_for_unshard(self):
    marked: list = []
    try:
        _cast_into_unsharded(self, marked)
        return UNSHARD.fsdp2["wait_for_unshard"](self)
    finally:
        for p in marked:
            p.__dict__.pop(_DIRECT, None)


# FSDP2's own method runs with functorch's transforms off where this torch does that (2.13): so
# does the cast before it
wait_for_unshard = getattr(_fsdp_common, "_disable_functorch_if_active", lambda f: f)(_wait_for_unshard)


def _all_gather_inputs(self) -> list[torch.Tensor]:
    direct = self.__dict__.get(_DIRECT)
    if direct is not None:
        return [direct]
    return INPUTS.fsdp2["all_gather_inputs"].fget(self)


UNSHARD = CollectivesPatch({"wait_for_unshard": wait_for_unshard}, owner=lambda: FSDPParamGroup)
INPUTS = CollectivesPatch({"all_gather_inputs": property(_all_gather_inputs)}, owner=lambda: FSDPParam)


def use_direct_unshard() -> bool:
    """One-rank unshards cast straight into the unsharded parameters; False (and nothing changed)
    where this torch's FSDP2 lacks `FSDPParamGroup.wait_for_unshard` or `FSDPParam.all_gather_inputs`,
    or other code has replaced them since an earlier install."""
    if not INPUTS.install():
        return False
    if UNSHARD.install():
        return True
    INPUTS.restore()
    return False


def restore_unshard() -> None:
    """FSDP2's cast and copy again (sharding.one_rank_copies=fsdp2, tests), unless other code has
    replaced the method or property since: theirs are left."""
    UNSHARD.restore()
    INPUTS.restore()


def _aliasable(group) -> bool:
    """A group whose reduce output may be its input: one rank, plain FSDP (HSDP's all-reduce and an
    all-reduce hook run the reduce's last reads on another stream, which the alias does not cover)."""
    return (_one_rank(group) and not isinstance(group.mesh_info, _fsdp_common.DDPMeshInfo)
            and getattr(group, "_all_reduce_hook", None) is None)


class OneRankReduceScatter(ReduceScatter):
    """A reduce-scatter comm for a one-rank group. FSDP2 allocates the reduce-scatter input on the
    compute stream, then an output of the same size on its reduce stream, and copies one into the
    other; the output handed back is the input, so that copy is of a tensor onto itself. Never
    called to communicate: with one rank FSDP2 does not.

    FSDP2 keeps the input alive only until the next reduce has waited for this one's copy; the
    output's later reads (the upcast of a bf16 reduce, gradient accumulation, the copy to the host
    under CPU offload) run on the reduce stream after that. The aliased buffer is therefore
    recorded on the reduce stream, so that the allocator hands it to no one until those reads are
    done (without it, the next unit's gradients were copied into it while the reduce stream still
    read it: reproduced on an H200 with a delayed reduce stream). An output is the input only for
    an allocation on another stream than the input's, so a pair cut short by an error leaves no
    stale input to be handed out."""

    def __init__(self, group=None):
        self._group = group
        self._input: torch.Tensor | None = None
        self._stream = None
        self.aliased = 0
        """reductions whose output was their input"""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        device = torch.device(device)
        stream = torch.cuda.current_stream(device) if device.type == "cuda" else None
        last, last_stream, self._input = self._input, self._stream, None
        if (last is not None and tuple(last.shape) == tuple(size) and last.dtype == dtype and last.device == device
                and (stream is None or stream != last_stream) and (self._group is None or _aliasable(self._group))):
            if stream is not None:
                last.record_stream(stream)
            self.aliased += 1
            return last
        self._input, self._stream = torch.empty(*size, dtype=dtype, device=device), stream
        return self._input

    def __call__(self, output_tensor, input_tensor, group, op, async_op: bool = False):
        raise RuntimeError("a one-rank reduce-scatter comm was asked to communicate: its group has more than one rank")


def alias_one_rank_reduces(model: nn.Module) -> int:
    """Give every one-rank FSDP2 group of `model` that still has FSDP2's default reduce-scatter comm
    (not symmetric memory's, not another custom one) the aliasing comm; how many got it. Set on the
    groups themselves: a module with several groups (torch 2.13's per-parameter meshes) has no
    single group for FSDPModule.set_custom_reduce_scatter."""
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    n = 0
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        state = m._get_fsdp_state()
        groups = state._fsdp_param_groups if hasattr(state, "_fsdp_param_groups") else [state._fsdp_param_group]
        for group in groups:
            if group is None or not _aliasable(group) or type(group._reduce_scatter_comm) is not DefaultReduceScatter:
                continue
            group._reduce_scatter_comm = OneRankReduceScatter(group)
            n += 1
    return n
