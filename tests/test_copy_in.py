"""FSDP2's all-gather copy-in in one pass (src/distributed/copy_in.py) over 2 gloo ranks on a CPU:
the gathered bf16 parameters, the losses and the sharded gradients are the same bits as FSDP2's own
two passes; groups the one pass does not cover go to FSDP2's functions; install and restore."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn

from src.distributed import copy_in

WORLD = 2


def _model() -> nn.Module:
    # odd sizes: each rank's padded shard differs from the other's, so a wrong offset shows
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 61), nn.ReLU(), nn.Linear(61, 29), nn.Linear(29, 5, bias=False))


def _run(choice: str, param_dtype, seen: list) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    if choice == "one_pass":
        assert copy_in.use_one_pass_copy_in()
    else:
        copy_in.restore_copy_in()
    mesh = init_device_mesh("cpu", (WORLD,))
    model = _model()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32)
    for layer in (model[0], model[2]):
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: the last linear
    gathered = []
    for layer in (model[0], model[2], model[3]):
        layer.register_forward_pre_hook(lambda m, _: gathered.append(m.weight.detach().clone()))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for _ in range(3):
        x = torch.randn(11, 37, generator=g)
        loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
    seen.append(gathered[0].dtype)
    return {"gathered": gathered, "losses": losses, "params": [p.full_tensor() for p in model.parameters()]}


def _rank(rank: int, init_file: str, out: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    original = _fsdp_collectives._get_param_all_gather_inputs
    staged = []  # groups that went through FSDP2's own cast into a staging buffer
    # counted where FSDP2 looks it up, before the install takes it for the original
    _fsdp_collectives._get_param_all_gather_inputs = lambda ps: staged.append(len(ps)) or original(ps)
    try:
        seen, results, counts = [], {}, {}
        for name, choice, dtype in (("fsdp2", "fsdp2", torch.bfloat16), ("one_pass", "one_pass", torch.bfloat16),
                                    ("fp32", "one_pass", None)):  # no param_dtype: FSDP2's own path, gathering fp32
            staged.clear()
            results[name] = _run(choice, dtype, seen)
            counts[name] = len(staged)
        if rank == 0:
            torch.save({"results": results, "staged": counts, "seen": seen}, out)
    finally:
        copy_in.restore_copy_in()
        dist.destroy_process_group()


def test_one_pass_copy_in_gathers_the_same_bits_as_fsdp2s_two(tmp_path: Path):
    out = tmp_path / "out.pt"
    mp.spawn(_rank, args=(str(tmp_path / "init"), str(out)), nprocs=WORLD, join=True)
    got = torch.load(out)
    two, one = got["results"]["fsdp2"], got["results"]["one_pass"]
    assert got["seen"][:2] == [torch.bfloat16, torch.bfloat16] and got["seen"][2] == torch.float32
    assert len(one["gathered"]) == 3 * 3  # three linears' forwards, three steps
    for name in ("gathered", "losses", "params"):
        assert len(one[name]) == len(two[name])
        assert all(torch.equal(a, b) for a, b in zip(one[name], two[name])), name
    assert not torch.equal(two["params"][0], _model()[0].weight)  # the steps moved the weights
    # FSDP2's own function: every gather of fsdp2's run (3 forward + 2 backward re-gathers a step) and
    # of the fp32 run; none of one_pass's, whose groups were cast straight into the all-gather buffer
    assert got["staged"] == {"fsdp2": 15, "one_pass": 0, "fp32": 15}


def test_install_and_restore_leave_others_alone():
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    inputs, metadatas = _fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas
    try:
        assert copy_in.use_one_pass_copy_in() and copy_in.use_one_pass_copy_in()  # twice: installed once
        assert copy_in.PATCH.original == {"_get_param_all_gather_inputs": inputs, "_get_all_gather_input_metadatas": metadatas}
        # the metadata of a list the inputs function did not hand out: FSDP2's own
        lists = [[torch.zeros(3, dtype=torch.bfloat16)], [torch.zeros(2, dtype=torch.bfloat16)]]
        assert _fsdp_collectives._get_all_gather_input_metadatas(lists) == metadatas(lists)
        # someone wraps it after the install: restore leaves theirs, a second install refuses
        later = lambda ps: inputs(ps)  # noqa: E731
        _fsdp_collectives._get_param_all_gather_inputs = later
        copy_in.restore_copy_in()
        assert _fsdp_collectives._get_param_all_gather_inputs is later
        assert not copy_in.use_one_pass_copy_in()
    finally:
        _fsdp_collectives._get_param_all_gather_inputs = copy_in._get_param_all_gather_inputs
        copy_in.restore_copy_in()
    assert (_fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas) == (inputs, metadatas)
    assert copy_in.PATCH.original is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU")
def test_one_pass_copy_in_on_nccl():
    """One NCCL rank, bf16 parameters gathered from fp32 shards: the gathered weights and gradients
    are the same bits with either copy-in, and no staging buffer is cast into."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        x = torch.randn(37, 37, device="cuda")
        out = {}
        for choice in ("fsdp2", "one_pass"):
            if choice == "one_pass":
                assert copy_in.use_one_pass_copy_in()
            else:
                copy_in.restore_copy_in()
            model = _model().cuda()
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)
            gathered = []
            model[2].register_forward_pre_hook(lambda m, _, seen=gathered: seen.append(m.weight.detach().clone()))
            model(x).float().square().mean().backward()
            out[choice] = gathered + [p.grad.full_tensor() for p in model.parameters()]
        assert out["one_pass"][0].dtype == torch.bfloat16
        assert all(torch.equal(a, b) for a, b in zip(out["one_pass"], out["fsdp2"]))
    finally:
        copy_in.restore_copy_in()
        dist.destroy_process_group()


def test_half_an_install_is_not_completed():
    """fsdp_patch's rule: where only some of a patch's functions are its own (put there by other
    code), install neither takes them for FSDP2's nor completes the set."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    inputs, metadatas = _fsdp_collectives._get_param_all_gather_inputs, _fsdp_collectives._get_all_gather_input_metadatas
    try:
        _fsdp_collectives._get_all_gather_input_metadatas = copy_in._get_all_gather_input_metadatas
        assert not copy_in.use_one_pass_copy_in() and copy_in.PATCH.original is None
        assert _fsdp_collectives._get_param_all_gather_inputs is inputs
    finally:
        _fsdp_collectives._get_all_gather_input_metadatas = metadatas
