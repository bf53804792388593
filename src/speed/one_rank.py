"""speed.one_rank_copies and speed.cast_in_step: FSDP2 on a one-rank shard group without its stand-in copies.

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

For mini_llm these copies are every device-to-device memcpy in a one-GPU profile of the seed's
eager step. The parameters and gradients are the same bits: the cast is the same fp32 -> bf16 copy
(round to nearest even), and the gradients are read from the buffer they were copied into rather
than a copy of it.

The unshard has no hook, so the method is wrapped: before FSDP2's own runs, each parameter it will
cast is cast into its unsharded storage, and `all_gather_inputs` hands FSDP2 that storage, so its
copy is of a tensor onto itself, which torch returns from at once. Groups this does not cover
(more than one rank, no lower param_dtype, CPU offload, tensor subclasses with their own
`fsdp_pre_all_gather` such as float8 weights, parameters kept sharded after forward) and anything
traced under torch.compile run FSDP2's path unchanged. FSDP2's private modules are imported when
first used, so this module imports on a torch that lacks them (the recipes' probes then say so).

On top of the direct unshard, `cast_in_step` (speed.cast_in_step) takes the cast out of the
unshard altogether: the unsharded storage is kept from one unshard to the next, TritonAdamW's
update writes each parameter's bf16 cast into it as it writes the fp32 parameter, and an unshard
casts only a parameter changed since (version counters say). 2 bytes a parameter of memory for
8.8 GB of casts a step on mini_llm.
"""
from __future__ import annotations

import torch
import torch.nn as nn

from src.speed.keep_unsharded import FREE, mark_kept, module_groups, public
from src.speed.patch import Patch
from src.speed.recipe import FSDP, Recipe
from src.speed.versions import TRITON_TESTED

_DIRECT = "_direct_all_gather_input"  # an FSDPParam's unsharded storage, already cast, for FSDP2's copy
_KEPT = "_kept_unsharded"  # an FSDPParam's UnshardedCopy: its unsharded storage is never freed (cast_in_step)
_KEEP = "_keep_unsharded"  # an FSDPParamGroup's (optimizer.write_copies, module or None): its parameters are kept from their next unshard on


def _common():
    from torch.distributed.fsdp._fully_shard import _fsdp_common

    return _fsdp_common


def _param():
    from torch.distributed.fsdp._fully_shard import _fsdp_param

    return _fsdp_param


def _param_group_class():
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    return FSDPParamGroup


def _one_rank(group) -> bool:
    # FSDP2's own test for its one-rank unshard path (a replicate-only group is left to it)
    return isinstance(group.mesh_info, _common().FSDPMeshInfo) and group._all_gather_process_group.size() == 1


def _casts_to(fsdp_param, dtype: torch.dtype | None) -> bool:
    """Whether unsharding casts the parameter's shard to `dtype` on the device, by FSDP2's own cast
    (no CPU offload, no tensor subclass with its own `fsdp_pre_all_gather`)."""
    return (dtype is not None and dtype != fsdp_param.sharded_param.dtype and not fsdp_param.offload_to_cpu
            and not hasattr(fsdp_param._sharded_local_tensor, "fsdp_pre_all_gather"))


def _castable(fsdp_param) -> bool:
    return _casts_to(fsdp_param, fsdp_param.param_dtype) and fsdp_param.sharded_state == _param().ShardedState.SHARDED


def _allocated(t: torch.Tensor) -> bool:
    return t.untyped_storage().size() == t.numel() * t.element_size()


class UnshardedCopy:
    """A one-rank parameter's unsharded storage kept from one unshard to the next (cast_in_step):
    `out`, FSDP2's flat param_dtype buffer, and what it was last cast from. FSDP2's fp32 shard is
    three tensors on one storage, each with its own version counter: the DTensor parameter (what an
    aten in-place op on the parameter moves, load_state_dict's copy_ among them), its local tensor
    (what TritonAdamW's update writes) and the flat shard (what the unshard reads). `versions` are
    the three counters when `out` last held the shard's cast: a change that moves any of them has
    the next unshard cast again (writes that move none: cast_in_step's docstring)."""

    __slots__ = ("out", "tensors", "versions")

    def __init__(self, out: torch.Tensor):
        self.out, self.tensors, self.versions = out, None, None

    def fresh(self, out: torch.Tensor, tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> bool:
        """`out` holds the cast of the shard as it is: cast there, or written by the optimizer's
        update (written()), and nothing written through the shard's tensors since; and its storage
        is still allocated (only the patched free_unsharded_param keeps it so)."""
        return (self.out is out and self.tensors is not None and _allocated(out) and all(a is b for a, b in zip(self.tensors, tensors))
                and self.versions == tuple(t._version for t in tensors))

    def cast(self, tensors: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
        """`out` was just cast from the shard: (parameter, local tensor, flat shard). A local tensor
        on another storage than the shard's (not FSDP2's layout) is not recorded, so nothing is
        ever taken as fresh."""
        _, local, shard = tensors
        same = local.untyped_storage().data_ptr() == shard.untyped_storage().data_ptr() and local.numel() == shard.numel()
        self.tensors = tensors if same else None
        self.versions = tuple(t._version for t in tensors)

    def written(self) -> None:
        """The optimizer's update has just written the parameter and `out` (its cast) together, and
        moved the parameter's counters as an in-place op would."""
        if self.tensors is not None:
            self.versions = tuple(t._version for t in self.tensors)


@torch.no_grad()
def _cast_into_unsharded(group, marked: list) -> None:
    """Cast each castable parameter of a one-rank group straight into its unsharded storage (the
    buffer FSDP2's copy would write) and mark it for `all_gather_inputs`, appending it to `marked`
    as it goes (the caller unmarks them whatever happens). A kept storage that still holds the
    shard's cast is not cast again."""
    if torch.compiler.is_compiling() or not group._all_gather_result or not _one_rank(group):
        return
    new = []
    for p in group.fsdp_params:
        if not _castable(p):
            continue
        shard = p._sharded_param_data
        p.init_all_gather_outputs([shard.numel()], [p.param_dtype], 1, group.device)
        out = p.all_gather_outputs[0]
        kept = p.__dict__.get(_KEPT)
        if kept is None and _KEEP in group.__dict__:  # its first unshard since cast_in_step: from now on kept
            _param().alloc_storage(out)
            kept = p.__dict__[_KEPT] = UnshardedCopy(out)
            mark_kept(p)  # FSDP2's free leaves it (keep_unsharded.py)
            new.append((p.sharded_param, kept))
        tensors = (p.sharded_param, p._sharded_local_tensor, shard)
        if kept is None or not kept.fresh(out, tensors):
            _param().alloc_storage(out)
            with torch.autograd._unsafe_preserve_version_counter(out):
                out.copy_(shard)
            if kept is not None and kept.out is out:
                kept.cast(tensors)
        marked.append(p)
        p.__dict__[_DIRECT] = out
    if new:
        write, module = group.__dict__[_KEEP]
        write(new)
        if module is not None:
            _stop_resharding(module)


def _stop_resharding(module: nn.Module) -> None:
    """Once every parameter of `module`'s groups is kept, resharding after forward would free
    nothing (the storage stays) and cost backward an unshard's Python per parameter: the module
    keeps its parameters unsharded from forward to backward."""
    groups = next(g for m, g in module_groups(module) if m is module)
    if all(_KEPT in p.__dict__ for g in groups for p in g.fsdp_params):
        module.set_reshard_after_forward(False, recurse=False)


def _wait_for_unshard(self):
    marked: list = []
    try:
        _cast_into_unsharded(self, marked)
        return UNSHARD.fsdp2["wait_for_unshard"](self)
    finally:
        for p in marked:
            p.__dict__.pop(_DIRECT, None)




def _all_gather_inputs(self) -> list[torch.Tensor]:
    direct = self.__dict__.get(_DIRECT)
    if direct is not None:
        return [direct]
    return INPUTS.fsdp2["all_gather_inputs"].fget(self)


UNSHARD = Patch({"wait_for_unshard": _wait_for_unshard}, owner=_param_group_class)
INPUTS = Patch({"all_gather_inputs": property(_all_gather_inputs)}, owner=lambda: _param().FSDPParam)


def use_direct_unshard() -> bool:
    """One-rank unshards cast straight into the unsharded parameters; False (and nothing changed)
    where this torch's FSDP2 lacks `FSDPParamGroup.wait_for_unshard` or `FSDPParam.all_gather_inputs`,
    or other code has replaced them since an earlier install."""
    if UNSHARD.fsdp2 is None and UNSHARD.replacements["wait_for_unshard"] is _wait_for_unshard:
        # FSDP2's own method runs with functorch's transforms off where this torch does that (2.13+):
        # so does the cast before it (wrapped once, at the first install: the patch compares by identity)
        disable = getattr(_common(), "_disable_functorch_if_active", lambda f: f)
        UNSHARD.replacements["wait_for_unshard"] = disable(_wait_for_unshard)
    if not INPUTS.install():
        return False
    if UNSHARD.install():
        return True
    INPUTS.restore()
    return False


def restore_unshard() -> None:
    """FSDP2's cast and copy again (speed.one_rank_copies=off, tests), unless other code has
    replaced the method or property since: theirs are left. Parameters kept by cast_in_step stay
    kept (their optimizer still writes their storage)."""
    UNSHARD.restore()
    INPUTS.restore()


def cast_in_step(model: nn.Module, optimizer) -> tuple[int, int]:
    """Have `optimizer`'s update write each one-rank fp32 parameter's bf16 cast straight into its
    unsharded storage, and keep that storage from one unshard to the next: an unshard then casts
    only a parameter changed since (version counters say; see below), where FSDP2 casts every
    parameter at every unshard (twice a step with reshard_after_forward); the update writes a fraction
    of those bytes instead. The cost is memory: the unsharded parameters stay, 2 bytes a parameter, as
    with reshard_after_forward=false.

    Needs the direct unshard (use_direct_unshard) and an optimizer with `write_copies`
    (TritonAdamW) that holds the model's parameters. FSDP2 settles each parameter's param_dtype at
    its first forward, so each is handed to the optimizer at its first unshard after this call;
    until then the optimizer writes no copy. A module whose parameters are then all kept no longer
    reshards after forward, which would free nothing. Returns how many parameters it will cover (0:
    none) and the bytes their kept storage will hold.

    What is seen as a change: an aten in-place op on the DTensor parameter (load_state_dict's
    copy_, `p.add_`) and the update itself. What is not: foreach ops on the parameters (torch's
    foreach AdamW, `_foreach_mul_`), writes through `.data`, torch.distributed.checkpoint's load:
    after such a write, call forget_casts."""
    write = getattr(optimizer, "write_copies", None)
    if write is None or not UNSHARD.installed() or not INPUTS.installed() or not (public() or FREE.install()):
        return 0, 0
    owned = {id(p) for group in optimizer.param_groups for p in group["params"]}
    n = nbytes = 0
    for module, groups in module_groups(model):
        kept_all, marked = bool(groups), []
        for group in groups:
            # what _castable will find at the first unshard, from what is known before it (FSDP2
            # sets param_dtype there, from each parameter's policy: torch 2.15 has no group policy):
            # fp32 parameters computed in bf16 (the update rounds to bf16 only)
            params = [p for p in group.fsdp_params if _one_rank(group) and p.mp_policy.param_dtype == torch.bfloat16
                      and p.sharded_param.dtype == torch.float32 and _casts_to(p, torch.bfloat16)]
            kept_all = kept_all and len(params) == len(group.fsdp_params)
            if not params:
                continue
            if any(id(p.sharded_param) not in owned for p in params):
                raise ValueError("speed.cast_in_step: the optimizer does not hold every parameter of the model's FSDP2 groups")
            marked.append(group)
            n += len(params)
            nbytes += sum(p.sharded_param.numel() for p in params) * torch.bfloat16.itemsize
        for group in marked:  # the module stops resharding once all its groups' parameters are kept
            group.__dict__[_KEEP] = (write, module if kept_all else None)
    return n, nbytes


def _groups(model: nn.Module):
    """Every FSDP2 parameter group of `model`."""
    for _, groups in module_groups(model):
        yield from groups


def forget_casts(model: nn.Module) -> int:
    """The next unshard casts every kept parameter again: for writes to the shards that move no
    version counter of theirs (torch.distributed.checkpoint's load copies into tensors of its own
    on the same storage). How many kept parameters there were."""
    n = 0
    for group in _groups(model):
        for p in group.fsdp_params:
            kept = p.__dict__.get(_KEPT)
            if kept is not None:
                kept.tensors, n = None, n + 1
    return n


def _aliasable(group) -> bool:
    """A group whose reduce output may be its input: one rank, plain FSDP (HSDP's all-reduce and an
    all-reduce hook run the reduce's last reads on another stream, which the alias does not cover)."""
    return (_one_rank(group) and not isinstance(group.mesh_info, _common().DDPMeshInfo)
            and getattr(group, "_all_reduce_hook", None) is None)


class OneRankReduceScatter:
    """A reduce-scatter comm for a one-rank group. FSDP2 allocates the reduce-scatter input on the
    compute stream, then an output of the same size on its reduce stream, and copies one into the
    other; the output handed back is the input, so that copy is of a tensor onto itself. Never
    called to communicate: with one rank FSDP2 does not.

    FSDP2 keeps the input alive only until the next reduce has waited for this one's copy; the
    output's later reads (the upcast of a bf16 reduce, gradient accumulation, the copy to the host
    under CPU offload) run on the reduce stream after that. The aliased buffer is therefore
    recorded on the reduce stream, so that the allocator hands it to no one until those reads are
    done (without it, the next unit's gradients were copied into it while the reduce stream still
    read it: reproduced with a delayed reduce stream). An output is the input only for
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
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    n = 0
    for group in _groups(model):
        if not _aliasable(group) or type(group._reduce_scatter_comm) is not DefaultReduceScatter:
            continue
        group._reduce_scatter_comm = OneRankReduceScatter(group)
        n += 1
    return n


def restore() -> None:
    """Both of one_rank_copies' replacements back to FSDP2's own (what cast_in_step marked kept stays kept)."""
    restore_unshard()


PARAM, GROUP = f"{FSDP}._fsdp_param:", f"{FSDP}._fsdp_param_group:"
COMMON, API = f"{FSDP}._fsdp_common:", f"{FSDP}._fsdp_api:"
_READS = (COMMON + "FSDPMeshInfo", COMMON + "DDPMeshInfo", PARAM + "ShardedState", PARAM + "alloc_storage",
          GROUP + "FSDPParamGroup.mesh_info", GROUP + "FSDPParamGroup.fsdp_params", GROUP + "FSDPParamGroup.device",
          GROUP + "FSDPParamGroup._all_gather_result", GROUP + "FSDPParamGroup._all_gather_process_group",
          PARAM + "FSDPParam.init_all_gather_outputs", PARAM + "FSDPParam.all_gather_outputs", PARAM + "FSDPParam.param_dtype",
          PARAM + "FSDPParam.sharded_param", PARAM + "FSDPParam.offload_to_cpu", PARAM + "FSDPParam._sharded_local_tensor",
          PARAM + "FSDPParam.sharded_state", PARAM + "FSDPParam._sharded_param_data", "torch.autograd:_unsafe_preserve_version_counter")
_SIGNATURES = {GROUP + "FSDPParamGroup.wait_for_unshard": ("self",), PARAM + "FSDPParam.all_gather_inputs": ("self",),
               PARAM + "FSDPParam.init_all_gather_outputs": ("self", "all_gather_input_numels", "all_gather_input_dtypes", "world_size", "device")}


def _originals() -> dict:
    return {**UNSHARD.originals(GROUP + "FSDPParamGroup."), **INPUTS.originals(PARAM + "FSDPParam.")}


RECIPE = Recipe(
    name="one_rank_copies",
    does="drops FSDP2's stand-in copies on a one-rank shard group (each unshard one cast into the unsharded parameters, "
         "each reduce's output its input)",
    replaces=(GROUP + "FSDPParamGroup.wait_for_unshard", PARAM + "FSDPParam.all_gather_inputs"),
    reads=(*_READS, GROUP + "FSDPParamGroup._reduce_scatter_comm", f"{FSDP}._fsdp_collectives:DefaultReduceScatter",
           API + "ReduceScatter.allocate"),
    signatures={**_SIGNATURES, API + "ReduceScatter.allocate": ("self", "size", "dtype", "device"),
                API + "ReduceScatter.__call__": ("self", "output_tensor", "input_tensor", "group", "op", "async_op")},
    gain="2.6-2.7 ms a step of +exp=fsdp4: docs/RESULTS.md, Speed recipes",
    parity="tests/unit/test_one_rank.py::test_direct_copies_give_fsdp2s_bits_without_its_casts_and_gradient_copies",
    restore=restore,
    originals=_originals,
)

CAST_RECIPE = Recipe(
    name="cast_in_step",
    does="has the Triton AdamW update write each one-rank parameter's bf16 cast into its kept unsharded storage, so unshards "
         "cast only what changed",
    replaces=(PARAM + "FSDPParam.free_unsharded_param",),
    reads=(*_READS, PARAM + "FSDPParam.mp_policy"),
    signatures={**_SIGNATURES, PARAM + "FSDPParam.free_unsharded_param": ("self",)},
    gain="1.8-2.0 ms a step of +exp=fsdp4 optim.impl=triton: docs/RESULTS.md, Speed recipes",
    parity="tests/unit/test_one_rank.py::test_the_update_writes_the_unsharded_parameters_and_unshards_cast_nothing_it_wrote",
    restore=restore,
    originals=lambda: {**_originals(), **FREE.originals(PARAM + "FSDPParam.")},
    triton=TRITON_TESTED,
    notes=("needs speed.one_rank_copies and optim.impl=triton; on torch 2.15+ the storage is kept by FSDP2's own "
           "keep_unsharded_storage, and free_unsharded_param is not replaced",),
)
