"""FSDP2 on one rank without its stand-in copies (src/speed/one_rank.py), on a one-rank gloo
group in process (and a one-rank NCCL group where a GPU is present): the unsharded bf16 parameters,
the losses, the gradients and the updated parameters are the same bits as FSDP2's own path, the
param-sized casts and gradient copies are gone, and the groups it does not cover keep FSDP2's."""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from src.speed import one_rank
from tests.support.devices import needs_gpu

aten = torch.ops.aten


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 61), nn.ReLU(), nn.Linear(61, 29), nn.Linear(29, 5, bias=False))


class _Copies(TorchDispatchMode):
    """Every copy between two distinct storages: (op, dtype written, elements)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, torch.dtype, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if func is aten.copy_.default:
            dst, src = args[0], args[1]
            if isinstance(dst, torch.Tensor) and isinstance(src, torch.Tensor) and type(dst) is torch.Tensor and type(src) is torch.Tensor \
                    and dst.untyped_storage().data_ptr() != src.untyped_storage().data_ptr():
                self.seen.append(("copy_", dst.dtype, dst.numel()))
        elif func is aten._to_copy.default and type(out) is torch.Tensor:
            self.seen.append(("_to_copy", out.dtype, out.numel()))
        return out


def _run(choice: str, device: str, param_dtype, reduce_dtype, offload: bool = False, optimizer: str = "adamw", in_step: bool = False,
         nudge_at: int | None = None, frozen: bool = False) -> dict:
    """Three steps of _model() on a one-rank mesh. `optimizer`: torch's AdamW or TritonAdamW;
    `in_step`: cast_in_step (the update writes the unsharded parameters); `nudge_at`: after that
    step a torch in-place op changes the first parameter, behind the optimizer; `frozen`: the
    second linear's bias takes no gradient (the update skips it)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard

    if choice == "direct":
        assert one_rank.use_direct_unshard()
    else:
        one_rank.restore_unshard()
    mesh = init_device_mesh(device, (1,))
    model = _model().to("cpu" if offload else device)
    model[2].bias.requires_grad_(not frozen)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kw = {"mesh": mesh, "mp_policy": policy, "offload_policy": CPUOffloadPolicy(pin_memory=False) if offload else OffloadPolicy()}
    for layer in (model[0], model[2]):
        fully_shard(layer, **kw)
    fully_shard(model, **kw)  # the root: the last linear
    comms = []
    if choice == "direct":
        assert one_rank.alias_one_rank_reduces(model) == 3
        comms = [m._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm for m in (model[0], model[2], model)]
    gathered = []
    for layer in (model[0], model[2], model[3]):
        layer.register_forward_pre_hook(lambda m, _: gathered.append(m.weight.detach().clone()))
    if optimizer == "triton":
        from perflab_kernels.triton.adamw import TritonAdamW

        opt = TritonAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    written = one_rank.cast_in_step(model, opt) if in_step else (0, 0)
    g = torch.Generator().manual_seed(1)
    losses, grads = [], []
    copies = _Copies()
    for step in range(3):
        x = torch.randn(11, 37, generator=g).to(device)
        with copies:
            loss = model(x).float().square().mean()
            loss.backward()
        losses.append(loss.detach().clone())
        grads.append([p.grad.full_tensor().cpu() for p in model.parameters() if p.grad is not None])
        opt.step()
        opt.zero_grad()
        if step == nudge_at:
            with torch.no_grad():
                next(model.parameters()).add_(0.25)
    assert not [p for m in model.modules() if hasattr(m, "_get_fsdp_state")
                for p in m._get_fsdp_state()._fsdp_param_group.fsdp_params if one_rank._DIRECT in p.__dict__]  # no marker left
    sizes = {p.numel() for p in model.parameters()}
    return {"gathered": [t.cpu() for t in gathered], "losses": [t.cpu() for t in losses], "grads": grads,
            "params": [p.full_tensor().cpu() for p in model.parameters()], "aliased": [c.aliased for c in comms],
            # param-sized casts to param_dtype (the unshard's new tensors) and fp32 copies of a
            # whole unit's gradients (the reduce's): what direct removes
            "casts": sum(1 for op, dt, n in copies.seen if op == "_to_copy" and dt == param_dtype and n in sizes),
            # the direct unshard's casts: param-sized copies into the unsharded storage
            "direct_casts": sum(1 for op, dt, n in copies.seen if op == "copy_" and dt == param_dtype and n in sizes),
            "copies": copies.seen, "written": written,
            "reshard_after_forward": [m._get_fsdp_state()._fsdp_param_group.post_forward_mesh_info is not None for m in (model[0], model[2])]}


@pytest.fixture
def one_rank_group():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        one_rank.restore_unshard()
        dist.destroy_process_group()


@pytest.fixture
def one_rank_device():
    """A one-rank group on the GPU where there is one (Triton's kernels run there; the interpreter
    is for CPUs), else on the CPU: the device's name."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dist.init_process_group("nccl" if device == "cuda" else "gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield device
    finally:
        one_rank.restore_unshard()
        dist.destroy_process_group()


def _compare(direct: dict, fsdp2: dict) -> None:
    for name in ("gathered", "losses", "params"):
        assert len(direct[name]) == len(fsdp2[name]) > 0
        assert all(torch.equal(a, b) for a, b in zip(direct[name], fsdp2[name])), name
    for a, b in zip(direct["grads"], fsdp2["grads"]):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), "grads"


def test_one_rank_gives_bf16_gradients_the_same_bits_reduced_in_fp32_as_in_bf16(one_rank_group):
    """What src/speed/apply.py's _reduce_dtype relies on: one rank reduces nothing, so bf16 gradients cast
    straight into an fp32 buffer are the bits of FSDP2's bf16 buffer upcast afterwards."""
    bf16 = _run("direct", "cpu", torch.bfloat16, torch.bfloat16)
    fp32 = _run("direct", "cpu", torch.bfloat16, torch.float32)
    _compare(fp32, bf16)


@pytest.mark.parametrize("overrides,world,reduced_in", [
    (["+exp=fsdp4_tuned", "dist.nproc=1"], 1, "float32"),  # bf16 = param_dtype on one rank: fp32, the same bits
    (["+exp=fsdp4_tuned", "dist.nproc=2"], 2, "bfloat16"),  # two ranks communicate: half the bytes
    (["+exp=fsdp4_tuned", "dist.nproc=1", "speed.one_rank_copies=off"], 1, "bfloat16"),  # FSDP2's own path, as asked
    (["+exp=fsdp4", "dist.nproc=1", "precision.param_dtype=float32", "precision.reduce_dtype=bfloat16"], 1, "bfloat16"),  # a rounding asked for
    (["+exp=fsdp4", "dist.nproc=1"], 1, "float32"),  # the seed's own fp32 reduce
])
def test_one_rank_reduces_in_fp32_only_where_bf16_would_round_nothing(overrides, world, reduced_in):
    from types import SimpleNamespace

    from src.config.compose import compose_config
    from src.speed.apply import _reduce_dtype, decide

    cfg = compose_config(overrides)
    direct = decide(cfg, world, "cuda", str(cfg.precision.reduce_dtype))["one_rank_copies"].on
    assert _reduce_dtype(cfg, SimpleNamespace(size=lambda: world), direct, main=False) == reduced_in


@pytest.mark.parametrize("reduce_dtype", [torch.float32, torch.bfloat16], ids=["fp32-reduce", "bf16-reduce"])
def test_direct_copies_give_fsdp2s_bits_without_its_casts_and_gradient_copies(one_rank_group, reduce_dtype):
    fsdp2 = _run("fsdp2", "cpu", torch.bfloat16, reduce_dtype)
    direct = _run("direct", "cpu", torch.bfloat16, reduce_dtype)
    _compare(direct, fsdp2)
    assert fsdp2["gathered"][0].dtype == torch.bfloat16
    # 3 steps: the two linear units' 4 parameters unshard in forward and again in backward, the
    # root's one weight once
    assert fsdp2["casts"] == 3 * (2 * 4 + 1) and direct["casts"] == 0
    # every reduce (3 groups, 3 steps) handed back its input as the output
    assert direct["aliased"] == [3, 3, 3]
    units = {37 * 61 + 61, 61 * 29 + 29, 29 * 5}  # each group's gradients, flat

    def unit_copies(run):
        return sum(1 for op, dt, n in run["copies"] if op == "copy_" and dt == reduce_dtype and n in units)

    assert unit_copies(fsdp2) - unit_copies(direct) == 9


def test_groups_it_does_not_cover_keep_fsdp2s_path(one_rank_group):
    # no param_dtype (fp32 compute): FSDP2's path (already one copy), and the same bits
    fsdp2 = _run("fsdp2", "cpu", None, torch.float32)
    direct = _run("direct", "cpu", None, torch.float32)
    _compare(direct, fsdp2)
    # CPU offload: the shards live on the host; FSDP2's own unshard moves and casts them
    fsdp2 = _run("fsdp2", "cpu", torch.bfloat16, torch.float32, offload=True)
    direct = _run("direct", "cpu", torch.bfloat16, torch.float32, offload=True)
    _compare(direct, fsdp2)
    assert direct["casts"] == fsdp2["casts"] > 0


def test_a_group_with_a_custom_reduce_scatter_keeps_it(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import DefaultReduceScatter

    class Mine(DefaultReduceScatter):
        pass

    model = _model()
    mesh = init_device_mesh("cpu", (1,))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    mine = Mine()
    model[0].set_custom_reduce_scatter(mine)
    assert one_rank.alias_one_rank_reduces(model) == 1  # the root only
    assert model[0]._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm is mine


def test_install_and_restore_leave_others_alone():
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
    from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

    one_rank.restore_unshard()
    wait, inputs = FSDPParamGroup.wait_for_unshard, FSDPParam.all_gather_inputs
    try:
        assert one_rank.use_direct_unshard() and one_rank.use_direct_unshard()  # twice: installed once
        assert one_rank.UNSHARD.fsdp2 == {"wait_for_unshard": wait} and one_rank.INPUTS.fsdp2 == {"all_gather_inputs": inputs}
        later = lambda self: wait(self)  # noqa: E731  someone wraps the method after the install
        FSDPParamGroup.wait_for_unshard = later
        one_rank.restore_unshard()
        assert FSDPParamGroup.wait_for_unshard is later and FSDPParam.all_gather_inputs is inputs
        assert not one_rank.use_direct_unshard()  # theirs is in place: neither half installs
        assert FSDPParam.all_gather_inputs is inputs
    finally:
        FSDPParamGroup.wait_for_unshard = wait
        one_rank.restore_unshard()
    assert (FSDPParamGroup.wait_for_unshard, FSDPParam.all_gather_inputs) == (wait, inputs)


@pytest.mark.gpu
@needs_gpu
def test_direct_copies_on_one_nccl_rank():
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        fsdp2 = _run("fsdp2", "cuda", torch.bfloat16, torch.float32)
        direct = _run("direct", "cuda", torch.bfloat16, torch.float32)
    finally:
        one_rank.restore_unshard()
        dist.destroy_process_group()
    _compare(direct, fsdp2)
    assert direct["casts"] == 0 and direct["aliased"] == [3, 3, 3]


def _slow_reduce_grads(choice: str, reduce_dtype, accumulate: bool, offload: bool, delay: int) -> list[torch.Tensor]:
    """Six identical units and a root on one NCCL rank; the reduce stream's post-reduce work held
    back by `delay` GPU cycles, so the next unit's reduce-scatter input is allocated while it runs."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    if choice == "direct":
        assert one_rank.use_direct_unshard()
    else:
        one_rank.restore_unshard()
    cast = _fsdp_collectives._to_dtype_if_needed

    def slow_cast(t, dtype):
        if t.is_cuda and torch.cuda.current_stream() != torch.cuda.default_stream():
            torch.cuda._sleep(delay)
        return cast(t, dtype)

    _fsdp_collectives._to_dtype_if_needed = slow_cast
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(6)], nn.Linear(1024, 8)).to("cpu" if offload else "cuda")
        kw = {"mesh": init_device_mesh("cuda", (1,)), "mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype),
              "offload_policy": CPUOffloadPolicy() if offload else OffloadPolicy()}
        for layer in model[:6]:
            fully_shard(layer, **kw)
        fully_shard(model, **kw)
        if choice == "direct":
            assert one_rank.alias_one_rank_reduces(model) == 7
        g = torch.Generator().manual_seed(1)
        for _ in range(2 if accumulate else 1):
            model(torch.randn(512, 1024, generator=g).cuda()).float().square().mean().backward()
        torch.cuda.synchronize()
        return [p.grad.to_local().cpu().clone() for p in model.parameters()]
    finally:
        _fsdp_collectives._to_dtype_if_needed = cast


@pytest.mark.gpu
@needs_gpu
@pytest.mark.parametrize("reduce_dtype, accumulate, offload", [(torch.bfloat16, False, False), (torch.float32, True, False), (torch.float32, False, True)],
                         ids=["bf16-reduce", "fp32-accumulated", "fp32-cpu-offload"])
def test_an_aliased_reduce_buffer_is_not_reused_while_the_reduce_stream_reads_it(reduce_dtype, accumulate, offload):
    """The reduce output read on the reduce stream after FSDP2 lets go of its input (the upcast, an
    accumulation, the copy to the host): with that stream held back 0.1 s a unit, the next unit's
    gradients must not be copied into the buffer meanwhile. Unrecorded on the reduce stream, they were."""
    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        want = _slow_reduce_grads("fsdp2", reduce_dtype, accumulate, offload, 0)
        got = _slow_reduce_grads("direct", reduce_dtype, accumulate, offload, 200_000_000)
    finally:
        one_rank.restore_unshard()
        dist.destroy_process_group()
    assert [i for i, (a, b) in enumerate(zip(got, want)) if not torch.equal(a, b)] == []


def test_hsdp_and_all_reduce_hooks_keep_fsdp2s_reduce_output(one_rank_group):
    """Their reduce output's last reads run on the all-reduce stream, which the alias's record does
    not cover: an HSDP group (a (1, 1) mesh) gets no aliasing comm, and a group given an all-reduce
    hook after it got one allocates a separate output again."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    hsdp = _model()
    fully_shard(hsdp, mesh=init_device_mesh("cpu", (1, 1), mesh_dim_names=("replicate", "shard")))
    assert one_rank.alias_one_rank_reduces(hsdp) == 0

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
    assert one_rank.alias_one_rank_reduces(model) == 1
    comm = model._get_fsdp_state()._fsdp_param_group._reduce_scatter_comm
    seen = []
    model.set_all_reduce_hook(lambda grad: seen.append(grad.numel()))
    model(torch.randn(3, 37)).square().mean().backward()
    assert seen and comm.aliased == 0


@pytest.mark.parametrize("nudge_at, frozen", [(None, False), (1, False), (None, True)],
                         ids=["optimizer-only", "changed-behind-the-optimizer", "a-frozen-bias"])
def test_the_update_writes_the_unsharded_parameters_and_unshards_cast_nothing_it_wrote(one_rank_device, nudge_at, frozen):
    """cast_in_step: the same bits as FSDP2's own path with the same optimizer, while the only
    casts left are the first forward's (the kept storage holds them through backward, and the
    update writes each step's); a parameter changed by a torch in-place op is cast again."""
    dev = one_rank_device
    kw = {"optimizer": "triton", "nudge_at": nudge_at, "frozen": frozen}
    fsdp2 = _run("fsdp2", dev, torch.bfloat16, torch.float32, **kw)
    direct = _run("direct", dev, torch.bfloat16, torch.float32, **kw)
    kept = _run("direct", dev, torch.bfloat16, torch.float32, in_step=True, **kw)
    _compare(kept, fsdp2)
    _compare(direct, fsdp2)
    assert kept["written"] == (5, 2 * (37 * 61 + 61 + 61 * 29 + 29 + 29 * 5))  # every parameter, 2 bytes each
    # FSDP2's 3 x (2 x 4 + 1) unshards of a parameter, cast each time; kept: the first forward's 5,
    # and the changed parameter's one more
    assert direct["direct_casts"] == 27
    assert kept["direct_casts"] == 5 + (nudge_at is not None)
    # the kept modules no longer reshard after forward (it would free nothing)
    assert direct["reshard_after_forward"] == [True, True] and kept["reshard_after_forward"] == [False, False]
    for m in ("fsdp2", "direct"):
        assert (fsdp2 if m == "fsdp2" else direct)["written"] == (0, 0)


def test_cast_in_step_needs_the_direct_unshard_and_an_optimizer_that_writes_copies(one_rank_group):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from perflab_kernels.triton.adamw import TritonAdamW

    model = _model()
    fully_shard(model, mesh=init_device_mesh("cpu", (1,)), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    assert one_rank.use_direct_unshard()
    assert one_rank.cast_in_step(model, torch.optim.AdamW(model.parameters())) == (0, 0)  # torch's update writes no copy
    one_rank.restore_unshard()
    triton = TritonAdamW(model.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert one_rank.cast_in_step(model, triton) == (0, 0)  # FSDP2's own unshard: nothing kept
    with pytest.raises(ValueError, match="this optimizer's own parameters"):
        TritonAdamW([torch.nn.Parameter(torch.ones(3))], lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0).write_copies(
            [(next(model.parameters()), one_rank.UnshardedCopy(torch.empty(3, dtype=torch.bfloat16)))])


def test_a_checkpoint_loaded_into_kept_parameters_is_cast_at_the_next_unshard(one_rank_device, tmp_path):
    """torch.distributed.checkpoint's load writes the shards through tensors of its own, moving no
    counter the kept casts compare: forget_casts has the next unshard cast them again."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from perflab_kernels.triton.adamw import TritonAdamW

    dev = one_rank_device
    assert one_rank.use_direct_unshard()
    model = _model().to(dev)
    fully_shard(model, mesh=init_device_mesh(dev, (1,)), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = TritonAdamW(model.parameters(), lr=1e-1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    assert one_rank.cast_in_step(model, opt)[0] == 5
    seen = []
    model[0].register_forward_pre_hook(lambda m, _: seen.append(m.weight.detach().clone()))
    x = torch.randn(4, 37, device=dev)
    dcp.save(model.state_dict(), checkpoint_id=str(tmp_path))
    before = next(model.parameters()).full_tensor().clone()
    for _ in range(2):
        model(x).float().sum().backward()
        opt.step()
        opt.zero_grad()
    state = model.state_dict()
    dcp.load(state, checkpoint_id=str(tmp_path))
    assert torch.equal(next(model.parameters()).full_tensor(), before)  # the shards hold the checkpoint
    model(x)
    model.reshard()  # the root keeps its parameters unsharded after forward
    assert not torch.equal(seen[-1], before.bfloat16())  # the kept storage still holds the last update's cast
    assert one_rank.forget_casts(model) == 5
    model(x)
    assert torch.equal(seen[-1], before.bfloat16())


def test_a_kept_storage_freed_behind_cast_in_step_is_not_written_and_is_cast_again(one_rank_device):
    """Only the patched free_unsharded_param keeps the storage: were it freed by other code, the
    update writes no copy into it and the next unshard casts into a new allocation."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from perflab_kernels.triton.adamw import TritonAdamW

    dev = one_rank_device
    assert one_rank.use_direct_unshard()
    model = _model().to(dev)
    fully_shard(model, mesh=init_device_mesh(dev, (1,)), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
    opt = TritonAdamW(model.parameters(), lr=1e-1, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.0)
    one_rank.cast_in_step(model, opt)
    seen = []
    model[0].register_forward_pre_hook(lambda m, _: seen.append(m.weight.detach().clone()))
    x = torch.randn(4, 37, device=dev)
    model(x).float().sum().backward()
    fsdp_param = model._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    fsdp_param.all_gather_outputs[0].untyped_storage().resize_(0)  # someone else frees it
    opt.step()
    model(x)
    assert torch.equal(seen[-1], fsdp_param.sharded_param.full_tensor().detach().bfloat16())
