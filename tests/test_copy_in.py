"""FSDP2's all-gather copy-in in one pass (src/speed/gather_copy_in.py) over gloo ranks on a CPU (and
NCCL ranks where two GPUs are present): the gathered bf16 parameters, the losses and the updated
parameters are the same bits as FSDP2's own two passes; the groups the one pass does not cover, and
a metadata function replaced by other code, go to FSDP2's functions; install and restore."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from src.speed import gather_copy_in as copy_in
from tests.spawned_ranks import spawn_ranks


def _model() -> nn.Module:
    # odd sizes: each rank's padded shard differs from the others', so a wrong offset shows
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 61), nn.ReLU(), nn.Linear(61, 29), nn.Linear(29, 5, bias=False))


def _run(choice: str, param_dtype, device: str, world: int, reshard) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if choice == "fsdp2":
        copy_in.restore()
    elif choice == "one_pass":
        assert copy_in.install()
    mesh = init_device_mesh(device, (world,))
    model = _model().to(device)
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: the last linear
    gathered = []
    for layer in (model[0], model[2], model[3]):
        layer.register_forward_pre_hook(lambda m, _: gathered.append(m.weight.detach().clone()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(11, 37, generator=g).to(device)
        loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    return {"gathered": [t.cpu() for t in gathered], "losses": [t.cpu() for t in losses],
            "params": [p.full_tensor().cpu() for p in model.parameters()]}


def _rank(rank: int, init_file: str, out: str, device: str, world: int, reshard) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    inputs, metadatas = _fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas
    staged = []  # groups that went through FSDP2's own cast into a staging buffer
    # counted where FSDP2 looks it up, before the install takes it for FSDP2's function
    _fsdp_collectives._get_param_all_gather_inputs = lambda ps: staged.append(len(ps)) or inputs(ps)
    try:
        results, counts = {}, {}
        runs = [("fsdp2", "fsdp2", torch.bfloat16), ("one_pass", "one_pass", torch.bfloat16),
                ("fp32", "one_pass", None),  # no param_dtype: FSDP2's own path, gathering fp32
                ("foreign", "foreign", torch.bfloat16)]  # other code replaced the metadata function after the install
        for name, choice, dtype in runs:
            if choice == "foreign":
                copy_in.install()
                _fsdp_collectives._get_all_gather_input_metadatas = lambda lists: metadatas(lists)
            staged.clear()
            results[name] = _run(choice, dtype, device, world, reshard)
            counts[name] = len(staged)
        if rank == 0:
            torch.save({"results": results, "staged": counts}, out)
    finally:
        _fsdp_collectives._get_all_gather_input_metadatas = copy_in._get_all_gather_input_metadatas
        copy_in.restore()
        dist.destroy_process_group()


def _check(got: dict, gathers: int) -> None:
    res = got["results"]
    two, one = res["fsdp2"], res["one_pass"]
    assert [t.dtype for t in (two["gathered"][0], one["gathered"][0], res["fp32"]["gathered"][0], res["foreign"]["gathered"][0])] == [
        torch.bfloat16, torch.bfloat16, torch.float32, torch.bfloat16]
    assert len(one["gathered"]) == 3 * 3  # three linears' forwards, three steps
    for run in (one, res["foreign"]):
        for name in ("gathered", "losses", "params"):
            assert len(run[name]) == len(two[name])
            assert all(torch.equal(a, b) for a, b in zip(run[name], two[name])), name
    assert not torch.equal(two["params"][0], _model()[0].weight)  # the steps moved the weights
    # FSDP2's own function: every gather of the fsdp2, fp32 and foreign runs; none of one_pass's,
    # whose groups were cast straight into the all-gather buffer
    assert got["staged"] == {"fsdp2": gathers, "one_pass": 0, "fp32": gathers, "foreign": gathers}


@pytest.mark.parametrize("world, reshard, gathers", [
    (2, True, 15),  # 3 forward gathers and 2 backward re-gathers a step (the root stays gathered)
    (4, 2, 15),  # reshard_after_forward=2: backward gathers from the kept post-forward shards (in bf16 already)
], ids=["2-ranks", "4-ranks-reshard-to-2"])
def test_one_pass_copy_in_gathers_the_same_bits_as_fsdp2s_two(tmp_path: Path, world, reshard, gathers):
    out = tmp_path / "out.pt"
    spawn_ranks(_rank, (str(tmp_path / "init"), str(out), "cpu", world, reshard), world)
    _check(torch.load(out), gathers)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs (one rank gathers nothing: FSDP2 skips its all-gather)")
def test_one_pass_copy_in_on_nccl(tmp_path: Path):
    out = tmp_path / "out.pt"
    spawn_ranks(_rank, (str(tmp_path / "init"), str(out), "cuda", 2, True), 2)
    _check(torch.load(out), 15)


def test_install_and_restore_leave_others_alone():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    copy_in.restore()  # an in-process fsdp2 run before this test (parallelize) left it installed
    inputs, metadatas = _fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas
    try:
        assert copy_in.install() and copy_in.install()  # twice: installed once
        assert copy_in.PATCH.fsdp2 == {"_get_param_all_gather_inputs": inputs, "_get_all_gather_input_metadatas": metadatas}
        # the metadata of a list the inputs function did not hand out: FSDP2's own
        lists = [[torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(2, dtype=torch.bfloat16)]]
        assert _fsdp_collectives._get_all_gather_input_metadatas(lists) == metadatas(lists)
        # someone wraps it after the install: restore leaves theirs, a second install refuses,
        # and ours, which theirs calls, still reaches FSDP2's function
        later = lambda ps: inputs(ps)  # noqa: E731
        _fsdp_collectives._get_param_all_gather_inputs = later
        copy_in.restore()
        assert _fsdp_collectives._get_param_all_gather_inputs is later
        assert not copy_in.install()
    finally:
        _fsdp_collectives._get_param_all_gather_inputs = copy_in._get_param_all_gather_inputs
        copy_in.restore()
    assert (_fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas) == (inputs, metadatas)
    assert not copy_in.PATCH.installed()
    assert copy_in._get_all_gather_input_metadatas(lists) == metadatas(lists)  # restored, and still callable
    assert copy_in.install()  # FSDP2's own functions back in place: installs again
    copy_in.restore()


def test_half_an_install_is_not_completed():
    """fsdp_patch's rule: where only some of a patch's functions are its own (put there by other
    code), install neither takes them for FSDP2's nor completes the set."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    copy_in.restore()
    inputs, metadatas = _fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas
    try:
        _fsdp_collectives._get_all_gather_input_metadatas = copy_in._get_all_gather_input_metadatas
        assert not copy_in.install()
        assert _fsdp_collectives._get_param_all_gather_inputs is inputs
    finally:
        _fsdp_collectives._get_all_gather_input_metadatas = metadatas
