"""FSDP2's all-gathers in place, from buffers the optimizer writes (`sharding.gather_in_place`).

On two or more ranks every FSDP2 all-gather builds its input anew: each fp32 shard is cast to
param_dtype into this rank's slice of a new output buffer (one pass with sharding.gather_copy_in=
one_pass: read 4 bytes, write 2 a parameter), the buffer is gathered in place, copied out into the
unsharded parameters and freed. Twice a step with reshard_after_forward. On mini_llm over two
H200s that copy-in is 0.82 ms an all-gather on the copy-in stream beside the GEMMs
(docs/PERFORMANCE.md 7, call g20), and the shards it reads only change in the optimizer's step.

Here each covered unit keeps its all-gather buffer from one step to the next, and TritonAdamW's
update, which holds every updated fp32 value in registers, also writes its bf16 cast into this
rank's slice of it (as optim.cast_in_step does on one rank, src/distributed/one_rank.py). The
all-gather then runs with no copy-in: only a shard changed by other means since (version counters
say, one_rank.UnshardedCopy) is cast again. The cast is the same fp32 -> bf16 copy as FSDP2's
(round to nearest even), so the gathered parameters are the same bits. The cost is memory: each
unit's whole buffer stays, the model's param_dtype size on every rank (1.47 GB for mini_llm in
bf16) whatever the rank count, so it is a setting of its own and off by default.

The buffer is read by the copy-out (compute stream) and written by NCCL (all-gather stream), the
re-casts (copy-in stream) and the update (compute stream, before the next forward, which FSDP2's
root makes the all-gather streams wait for). Each copy-out records an event, and the unit's next
all-gather waits for it before anything writes the buffer again: a backward re-gather never
overwrites a slice its forward's copy-out has yet to read.

FSDP2 has no hook inside its all-gather, so `foreach_all_gather` and `foreach_all_gather_copy_out`
are replaced where `_fsdp_param_group` looks them up, as a pair. Units it does not cover (one rank,
no bf16 param_dtype under fp32 parameters, CPU offload, tensor subclasses with their own
`fsdp_pre_all_gather` such as float8 weights, a shard dimension other than 0, a custom all-gather
comm such as symmetric memory's, parameters kept sharded after forward) and anything traced under
torch.compile go to FSDP2's functions unchanged. Process-wide; where the installed torch's
functions differ from those this was written against, nothing changes and `use_gather_in_place`
says so.
"""
from __future__ import annotations

import inspect

import torch
import torch.nn as nn
from torch.distributed.device_mesh import _get_device_handle
from torch.distributed.fsdp._fully_shard import _fsdp_common
from torch.distributed.fsdp._fully_shard._fsdp_param import ShardedState

from src.distributed.fsdp_patch import CollectivesPatch, collectives
from src.distributed.kept_unshard import module_groups
from src.distributed.one_rank import UnshardedCopy, _allocated, _casts_to

_WANT = "_gather_in_place"  # on a unit's first FSDPParam: (optimizer.write_copies, its group) until its first all-gather
_GATHER = "_kept_gather"  # on a unit's first FSDPParam: its KeptGather from then on

# what FSDP2's functions take and return where this was written (torch 2.11-2.13); any other and
# nothing is installed
_GATHER_ARGS = ("fsdp_params", "group", "async_op", "all_gather_copy_in_stream", "all_gather_stream", "device", "all_gather_comm")
_COPY_OUT_ARGS = ("all_gather_result", "fsdp_params", "group")
_RESULT_FIELDS = ("all_gather_output", "all_gather_event", "all_gather_work", "param_all_gather_input_dtypes",
                  "param_all_gather_input_numels", "all_gather_input_split_sizes")


def _param_group_module():
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    return _fsdp_param_group


def _multi_rank(group) -> bool:
    return isinstance(group.mesh_info, _fsdp_common.FSDPMeshInfo) and group._all_gather_process_group.size() > 1


def _coverable(fsdp_param, dtype: torch.dtype | None) -> bool:
    """An fp32 shard of dim 0 that unsharding casts to bf16 by FSDP2's own cast."""
    return (dtype == torch.bfloat16 and fsdp_param.sharded_param.dtype == torch.float32 and _casts_to(fsdp_param, dtype)
            and fsdp_param.fsdp_placement.dim == 0)


class KeptGather:
    """One unit's all-gather buffer, kept: `buffer` (world x this rank's padded shards, in FSDP2's
    layout), `input` (this rank's slice), per parameter its padded slice (`dsts`, what a re-cast
    writes) and an UnshardedCopy of the slice's first elements, the local shard's (what the update
    writes); the metadata FSDP2's copy-out reads; the event of the last copy-out; how many shards
    it has cast (`casts`: the update wrote the others)."""

    def __init__(self, fsdp_params: list, world: int, rank: int, device: torch.device):
        self.params = fsdp_params
        numels = [p._sharded_param_data.numel() for p in fsdp_params]  # padded: every rank's slice the same size
        total = sum(numels)
        self.buffer = torch.empty(total * world, dtype=torch.bfloat16, device=device)
        self.input = self.buffer.narrow(0, total * rank, total)
        self.dsts = list(self.input.split(numels))
        self.copies = [UnshardedCopy(dst[:p._sharded_local_tensor.numel()]) for p, dst in zip(fsdp_params, self.dsts)]
        self.split_sizes = numels
        self.dtypes = [[torch.bfloat16] for _ in fsdp_params]
        self.numels = [[n] for n in numels]
        self.copied_out = None
        self.casts = 0

    def refresh(self) -> int:
        """Cast each shard whose slice no longer holds its cast (changed since, or never cast) into
        its slice, in one foreach copy; how many."""
        if not _allocated(self.buffer):  # freed by other code: every slice is stale
            self.buffer.untyped_storage().resize_(self.buffer.numel() * self.buffer.element_size())
            for copy in self.copies:
                copy.tensors = None
        stale = []
        for i, (p, copy) in enumerate(zip(self.params, self.copies)):
            tensors = (p.sharded_param, p._sharded_local_tensor, p._sharded_param_data)
            if not copy.fresh(copy.out, tensors):
                stale.append((i, tensors))
        if stale:
            torch._foreach_copy_([self.dsts[i] for i, _ in stale], [t[2] for _, t in stale])
            for i, tensors in stale:
                self.copies[i].cast(tensors)
        self.casts += len(stale)
        return len(stale)


def _kept(fsdp_params: list, group, all_gather_comm) -> KeptGather | None:
    """The unit's KeptGather where this all-gather takes the in-place path (made at its first),
    else None."""
    if not fsdp_params or torch.compiler.is_compiling():
        return None
    first = fsdp_params[0].__dict__
    kept = first.get(_GATHER)
    if kept is None:
        want = first.get(_WANT)
        if want is None:
            return None
        write, param_group = want
        if param_group.fsdp_params is not fsdp_params or not _multi_rank(param_group):
            return None
        if not all(_coverable(p, p.param_dtype) for p in fsdp_params):  # FSDP2 settled param_dtype otherwise
            del first[_WANT]
            return None
        kept = KeptGather(fsdp_params, group.size(), group.rank(), param_group.device)
        write([(p.sharded_param, copy) for p, copy in zip(fsdp_params, kept.copies)])
        del first[_WANT]
        first[_GATHER] = kept
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultAllGather

    if (kept.params is not fsdp_params or type(all_gather_comm) is not DefaultAllGather
            or any(p.sharded_state != ShardedState.SHARDED for p in fsdp_params)):
        return None
    return kept


@torch.no_grad()
def foreach_all_gather(fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream, device, all_gather_comm):
    kept = _kept(fsdp_params, group, all_gather_comm)
    if kept is None:
        return PATCH.fsdp2["foreach_all_gather"](fsdp_params, group, async_op, all_gather_copy_in_stream, all_gather_stream,
                                                 device, all_gather_comm)
    handle = _get_device_handle(device.type)
    with handle.stream(all_gather_copy_in_stream):
        if kept.copied_out is not None:  # nothing writes the buffer before the last copy-out has read it
            all_gather_copy_in_stream.wait_event(kept.copied_out)
        kept.refresh()
    all_gather_stream.wait_stream(all_gather_copy_in_stream)
    with handle.stream(all_gather_stream):
        work = all_gather_comm(output_tensor=kept.buffer, input_tensor=kept.input, group=group, async_op=async_op)
        event = all_gather_stream.record_event()
        return collectives().AllGatherResult(kept.buffer, event, work, kept.dtypes, kept.numels, kept.split_sizes)


def foreach_all_gather_copy_out(all_gather_result, fsdp_params, group):
    PATCH.fsdp2["foreach_all_gather_copy_out"](all_gather_result, fsdp_params, group)
    kept = fsdp_params[0].__dict__.get(_GATHER) if fsdp_params else None
    if kept is not None and all_gather_result.all_gather_output is kept.buffer:
        kept.copied_out = _get_device_handle(kept.buffer.device.type).current_stream().record_event()


PATCH = CollectivesPatch({"foreach_all_gather": foreach_all_gather, "foreach_all_gather_copy_out": foreach_all_gather_copy_out},
                         owner=_param_group_module)


def _matches() -> bool:
    """FSDP2's functions take and return what this module was written against."""
    try:
        c = collectives()
        names = [tuple(inspect.signature(f).parameters) for f in (c.foreach_all_gather, c.foreach_all_gather_copy_out)]
        return (names == [_GATHER_ARGS, _COPY_OUT_ARGS] and tuple(c.AllGatherResult._fields) == _RESULT_FIELDS
                and hasattr(c, "DefaultAllGather"))
    except (ImportError, AttributeError, TypeError, ValueError):
        return False


def use_gather_in_place() -> bool:
    """Route FSDP2's all-gathers through the kept buffers (units marked by gather_in_place only);
    False, and nothing changed, where this torch's FSDP2 differs or other code replaced the functions."""
    return _matches() and PATCH.install()


def restore_gather() -> None:
    """FSDP2's all-gather and copy-out again (tests; units already kept fall back to FSDP2's path)."""
    PATCH.restore()


def gather_in_place(model: nn.Module, optimizer) -> tuple[int, int]:
    """Have `optimizer`'s update write each multi-rank fp32 parameter's bf16 cast into this rank's
    slice of its unit's kept all-gather buffer, so the unit's all-gathers run with no copy-in. A
    unit is covered whole or not at all (its buffer is one tensor); covered from its first
    all-gather on, when FSDP2 has settled param_dtype. Needs an optimizer with `write_copies`
    (TritonAdamW) holding the model's parameters. Returns the parameters covered (0: none) and the
    bytes the kept buffers will hold on this rank.

    What is seen as a change to a shard, as for cast_in_step: the update itself and an aten in-place
    op on the DTensor parameter. Not seen: foreach ops on the parameters, writes through `.data`,
    torch.distributed.checkpoint's load; after such a write, call forget_gathers."""
    write = getattr(optimizer, "write_copies", None)
    if write is None or not use_gather_in_place():
        return 0, 0
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    n = nbytes = 0
    for _, groups in module_groups(model):
        for group in groups:
            params = group.fsdp_params
            if not params or not _multi_rank(group) or not all(_coverable(p, group.mp_policy.param_dtype) for p in params):
                continue
            if any(id(p.sharded_param) not in owned for p in params):
                raise ValueError("sharding.gather_in_place: the optimizer does not hold every parameter of the model's FSDP2 groups")
            params[0].__dict__[_WANT] = (write, group)
            n += len(params)
            nbytes += group._all_gather_process_group.size() * sum(p._sharded_param_data.numel() for p in params) * 2
    return n, nbytes


def forget_gathers(model: nn.Module) -> int:
    """The next all-gather of every kept unit casts all its shards again (after writes that move
    no version counter, such as a checkpoint load); how many parameters that covers."""
    n = 0
    for _, groups in module_groups(model):
        for group in groups:
            kept = group.fsdp_params[0].__dict__.get(_GATHER) if group.fsdp_params else None
            if kept is not None:
                for copy in kept.copies:
                    copy.tensors = None
                n += len(kept.copies)
    return n


def gather_counts(model: nn.Module) -> dict[str, int]:
    """What the kept units did in this process: `gathered_in_place` parameters covered and
    `gather_in_place_casts` shards their all-gathers cast (the first all-gather's, and those changed
    behind the optimizer since; the update wrote every other)."""
    params = casts = 0
    for _, groups in module_groups(model):
        for group in groups:
            kept = group.fsdp_params[0].__dict__.get(_GATHER) if group.fsdp_params else None
            if kept is not None:
                params, casts = params + len(kept.copies), casts + kept.casts
    return {"gathered_in_place": params, "gather_in_place_casts": casts}
