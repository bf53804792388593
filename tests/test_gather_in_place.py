"""FSDP2's all-gathers in place from buffers the update writes (src/distributed/gather_in_place.py),
over gloo ranks on a CPU (TritonAdamW in Triton's interpreter) and NCCL ranks where two GPUs are
present: the gathered bf16 parameters, the losses and the updated parameters are the same bits as
FSDP2's own path with the same optimizer, while the only casts left are the first all-gather's and
those of a shard changed behind the optimizer; units it does not cover keep FSDP2's path."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from src.compose import ConfigError
from src.distributed import copy_in, gather_in_place
from src.run import preflight
from tests.spawned_ranks import spawn_ranks


def _model() -> nn.Module:
    # odd row counts: FSDP2 pads each rank's shard to ceil(rows / 2) rows, so the last rank's slice
    # holds padding past its local shard (what the update writes), and a wrong offset shows
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(37, 61), nn.ReLU(), nn.Linear(61, 29), nn.Linear(29, 3, bias=False))


def _run(in_place: bool, device: str, world: int, reshard: bool, nudge_at: int | None = None, fp32_unit: bool = False,
         load_at: int | None = None, tmp: str | None = None) -> dict:
    """Three steps of _model() with TritonAdamW. `nudge_at`: after that step a torch in-place op
    changes the first weight behind the optimizer; `fp32_unit`: the first linear's unit computes in
    fp32 (nothing to cast: not covered); `load_at`: after that step a checkpoint of the model as it
    was before the first step is loaded through DCP (moves no counter), then forget_gathers."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from kernels.triton.adamw import TritonAdamW

    gather_in_place.restore_gather()
    mesh = init_device_mesh(device, (world,))
    model = _model().to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=MixedPrecisionPolicy(param_dtype=torch.float32) if fp32_unit else policy, reshard_after_forward=reshard)
    fully_shard(model[2], mesh=mesh, mp_policy=policy, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: the last linear
    gathered = []
    for layer in (model[0], model[2], model[3]):
        layer.register_forward_pre_hook(lambda m, _: gathered.append(m.weight.detach().clone()))
    opt = TritonAdamW(model.parameters(), lr=1e-2, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    covered = gather_in_place.gather_in_place(model, opt) if in_place else (0, 0)
    if load_at is not None:
        dcp.save(model.state_dict(), checkpoint_id=tmp)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    losses = []
    for step in range(3):
        x = torch.randn(11, 37, generator=g).to(device)
        loss = model(x).float().square().mean()
        loss.backward()
        losses.append(loss.detach().clone())
        opt.step()
        opt.zero_grad()
        if step == nudge_at:
            with torch.no_grad():
                model[0].weight.add_(0.25)
        if step == load_at:
            state = model.state_dict()
            dcp.load(state, checkpoint_id=tmp)
            if in_place:
                assert gather_in_place.forget_gathers(model) == (3 if fp32_unit else 5)
    kept = [m._get_fsdp_state()._fsdp_param_group.fsdp_params[0].__dict__.get(gather_in_place._GATHER) for m in (model[0], model[2], model)]
    return {"gathered": [t.cpu() for t in gathered], "losses": [t.cpu() for t in losses],
            "params": [p.full_tensor().cpu() for p in model.parameters()], "covered": covered,
            "casts": [k.casts if k is not None else None for k in kept]}


def _rank(rank: int, init_file: str, out: str, device: str, world: int, reshard: bool, tmp: str) -> None:
    torch.set_num_threads(1)
    if device == "cuda":
        torch.cuda.set_device(rank)
    dist.init_process_group("nccl" if device == "cuda" else "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    assert copy_in.use_one_pass_copy_in()  # the project's default copy-in for the units left to FSDP2
    try:
        runs = {"fsdp2": dict(in_place=False), "in_place": dict(in_place=True),
                "fsdp2_nudged": dict(in_place=False, nudge_at=1), "in_place_nudged": dict(in_place=True, nudge_at=1),
                "fsdp2_fp32_unit": dict(in_place=False, fp32_unit=True), "in_place_fp32_unit": dict(in_place=True, fp32_unit=True),
                "fsdp2_loaded": dict(in_place=False, load_at=0), "in_place_loaded": dict(in_place=True, load_at=0)}
        results = {name: _run(device=device, world=world, reshard=reshard, tmp=f"{tmp}/{name}", **kw) for name, kw in runs.items()}
        if rank == 0:
            torch.save(results, out)
    finally:
        gather_in_place.restore_gather()
        copy_in.restore_copy_in()
        dist.destroy_process_group()


def _check(res: dict, reshard: bool) -> None:
    for variant in ("", "_nudged", "_fp32_unit", "_loaded"):
        own, ours = res["fsdp2" + variant], res["in_place" + variant]
        for name in ("gathered", "losses", "params"):
            assert len(ours[name]) == len(own[name]) > 0
            assert all(torch.equal(a, b) for a, b in zip(ours[name], own[name])), (variant, name)
        assert own["casts"] == [None, None, None] and own["covered"] == (0, 0)
    assert not torch.equal(res["in_place"]["params"][0], _model()[0].weight)  # the steps moved the weights
    assert not torch.equal(res["in_place_nudged"]["params"][0], res["in_place"]["params"][0])
    world = 2
    sizes = [61 * 37 + 61, 29 * 61 + 29, 3 * 29]  # the units' parameters, padded below to whole rows a rank
    padded = [(-(-61 // world)) * world * 37 + (-(-61 // world)) * world, (-(-29 // world)) * world * 61 + (-(-29 // world)) * world,
              (-(-3 // world)) * world * 29]
    assert sum(sizes) <= sum(padded)
    assert res["in_place"]["covered"] == (5, 2 * sum(padded))  # every parameter; the buffers hold every rank's padded shards in bf16
    # the first all-gather of each unit casts its shards (2, 2, 1); after that the update writes
    # them, so the forward and backward gathers of steps 2 and 3 cast nothing
    assert res["in_place"]["casts"] == [2, 2, 1]
    assert res["in_place_nudged"]["casts"] == [3, 2, 1]  # the nudged weight once more
    assert res["in_place_fp32_unit"]["casts"] == [None, 2, 1]  # fp32 compute: FSDP2's own gather
    assert res["in_place_fp32_unit"]["gathered"][0].dtype == torch.float32
    assert res["in_place_fp32_unit"]["covered"][0] == 3
    assert res["in_place_loaded"]["casts"] == [4, 4, 2]  # every shard again after the load


@pytest.mark.skipif(torch.cuda.is_available(), reason="the gloo ranks' Triton AdamW runs in Triton's interpreter, on a machine without a GPU; "
                    "with two GPUs the NCCL test below runs instead")
@pytest.mark.parametrize("reshard", [True, False], ids=["reshard-after-forward", "kept-to-backward"])
def test_gathers_in_place_give_fsdp2s_bits_without_its_copy_ins(tmp_path: Path, reshard):
    out = tmp_path / "out.pt"
    spawn_ranks(_rank, (str(tmp_path / "init"), str(out), "cpu", 2, reshard, str(tmp_path)), 2)
    _check(torch.load(out), reshard)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 NVIDIA GPUs (one rank gathers nothing: FSDP2 skips its all-gather)")
def test_gathers_in_place_on_nccl(tmp_path: Path):
    out = tmp_path / "out.pt"
    spawn_ranks(_rank, (str(tmp_path / "init"), str(out), "cuda", 2, True, str(tmp_path)), 2)
    _check(torch.load(out), True)


@pytest.mark.parametrize("overrides, message", [
    (["sharding=none", "precision=bf16", "optim.impl=triton"], "sharding.gather_in_place=true keeps FSDP2's all-gather buffers, and sharding=none gathers none"),
    (["precision=bf16", "optim.impl=foreach"], "and optim.impl=foreach writes none; set optim.impl=triton (or kernels=auto"),
    (["precision=bf16", "optim.impl=auto"], "and optim.impl=auto writes none"),
    (["precision=fp32", "optim.impl=triton"], "and precision=fp32 computes in float32; use precision=bf16"),
], ids=["no-fsdp", "foreach-adamw", "auto-without-kernels-auto", "fp32"])
def test_gather_in_place_refuses_what_would_leave_it_nothing_to_gather(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(["dist.nproc=2", "sharding.gather_in_place=true", *overrides], multirun=False)
    assert message in str(err.value)


def test_gather_in_place_composes_with_kernels_auto():
    backend = "cuda" if torch.cuda.is_available() else "cpu"  # on a CPU the fused kernels run in Triton's interpreter
    preflight([f"backend={backend}", "dist.nproc=2", "dist.fake=true", "precision=bf16", "model=mini_llm", "kernels=auto", "kernels.diagnosis=tests/fixtures/mini_llm_h200_diagnosis.json",
               "sharding.gather_in_place=true"], multirun=False)


def test_a_faked_two_rank_run_gathers_the_updates_own_casts(tmp_path: Path):
    """dist.fake (rank 0 of 2 alone, on the GPU where there is one): over 3 steps of the tiny model
    each unit's kept slice is cast once, at its first all-gather; after the last update, this rank's
    slice of every unit's buffer holds the bf16 cast of its fp32 shard, bit for bit, written by the
    Triton update (compiled on a GPU, interpreted on a CPU) into views at an offset of that buffer."""
    from src.compose import compose_config
    from src.distributed.env import shutdown
    from src.runtime import RunContext
    from src.train.trainer import Trainer

    backend = "cuda" if torch.cuda.is_available() else "cpu"
    cfg = compose_config([f"backend={backend}", "dist.nproc=2", "dist.fake=true", "tracking=none", "precision=bf16", "optim.impl=triton",
                          "sharding.gather_in_place=true", "model.dim=40", "model.n_heads=4", "train.steps=3"])
    trainer = Trainer(cfg, RunContext(run_dir=None, cwd=str(tmp_path)))
    try:
        summary = trainer.train()
        kept = [g.fsdp_params[0].__dict__[gather_in_place._GATHER] for _, groups in gather_in_place.module_groups(trainer.model) for g in groups]
        n = sum(len(k.copies) for k in kept)
        assert n == len(list(trainer.model.parameters())) and len(kept) > 2
        assert summary["gathered_in_place"] == n and summary["gather_in_place_casts"] == n  # the first all-gathers' casts only
        for k in kept:
            for p, dst in zip(k.params, k.dsts):
                local = p._sharded_local_tensor.reshape(-1)
                assert torch.equal(dst[:local.numel()], local.bfloat16())  # rounded to nearest even, as torch's cast
    finally:
        shutdown()
