"""speed.keep_unsharded over 2 gloo ranks: the gathered parameters stay at the same addresses
from step to step (where FSDP2 alone frees them after every step), backward gathers nothing, and
the losses and updated parameters are the same bits as FSDP2's own freeing and re-gathering."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.config.compose import compose_config
from src.data.batches import TokenBatches
from src.distributed.env import build_mesh
from src.distributed.parallelize import parallelize
from src.models import build_model
from src.speed.keep_unsharded import FREE, KEPT, module_groups
from src.train.loop import train_step
from tests.support.ranks import spawn_ranks

WORLD, STEPS = 2, 3


def _gathers() -> list[int]:
    """A counter of FSDP2's all-gathers (one a unit's unshard, in forward or backward), from the
    name its parameter groups call."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group

    calls = [0]
    gather = _fsdp_param_group.foreach_all_gather

    def counted(*a, **k):
        calls[0] += 1
        return gather(*a, **k)

    _fsdp_param_group.foreach_all_gather = counted
    return calls


def _rank(rank: int, init_file: str, out: str, overrides: list[str]) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = opt = None
    try:
        cfg = compose_config(["data.batch_size=2", "data.seq_len=16", *overrides])
        with torch.device("meta"):
            model = build_model(cfg.model)
        model = parallelize(model, cfg, build_mesh("cpu", WORLD, "fsdp2", replicate=1), torch.device("cpu")).model
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
        batches = TokenBatches("random", cfg.model.vocab_size, 2, 16, 3, rank, WORLD)
        block_group = model.layers[0]._get_fsdp_state()._fsdp_param_group
        param = block_group.fsdp_params[0]
        calls = _gathers()
        losses, where, gathers = [], [], []
        for _ in range(STEPS):
            x, y = next(batches)
            before = calls[0]
            loss, _ = train_step(model, opt, x, y)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
            gathers.append(calls[0] - before)
            storage = param.all_gather_outputs[0].untyped_storage()
            where.append(storage.data_ptr() if storage.size() else 0)  # after the step: 0 if freed
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        groups = [g for _, gs in module_groups(model) for g in gs if g.fsdp_params]
        if rank == 0:
            torch.save({"losses": losses, "params": full, "where": where, "gathers": gathers,
                        "kept": [bool(p.__dict__.get(KEPT) or getattr(p, "keep_unsharded_storage", False)) for p in block_group.fsdp_params],
                        "reshards_after_forward": block_group.post_forward_mesh_info is not None,
                        "units": len(groups), "resharding_units": sum(g.post_forward_mesh_info is not None for g in groups)}, out)
    finally:
        del model, opt
        gc.collect()
        dist.destroy_process_group()


def _run(tmp_path: Path, name: str, overrides: list[str]) -> dict:
    d = tmp_path / name
    d.mkdir()
    spawn_ranks(_rank, (str(d / "rdzv"), str(d / "rank0.pt"), overrides), WORLD)
    return torch.load(d / "rank0.pt", weights_only=True)


LAYOUTS = {"fsdp2": [], "split_root": ["sharding.split_root=true", "precision.reduce_dtype=bfloat16"]}


@pytest.fixture(scope="module", params=list(LAYOUTS))
def runs(request, tmp_path_factory) -> dict[str, dict]:
    """FSDP2 as it is and kept, in the default layout and in +exp=fsdp4_tuned's (embedding and head
    as units of their own, bf16 reduction)."""
    tmp = tmp_path_factory.mktemp(request.param)
    layout = LAYOUTS[request.param]
    return {"fsdp2": _run(tmp, "fsdp2", layout), "kept": _run(tmp, "kept", [*layout, "speed.keep_unsharded=true"])}


def test_kept_parameters_are_gathered_into_the_same_memory_every_step(runs):
    fsdp2, kept = runs["fsdp2"], runs["kept"]
    assert fsdp2["where"] == [0] * STEPS  # FSDP2 frees the gathered block after every step
    assert kept["where"][0] and len(set(kept["where"])) == 1, kept["where"]  # kept: one address, all steps
    assert all(kept["kept"]) and not any(fsdp2["kept"])


def test_kept_units_gather_once_a_step_where_fsdp2_gathers_again_for_backward(runs):
    fsdp2, kept = runs["fsdp2"], runs["kept"]
    assert not kept["reshards_after_forward"] and fsdp2["reshards_after_forward"]
    # kept: each unit gathered once, in forward; FSDP2 gathers the units that reshard after forward
    # (the 2 blocks, and the embedding where it is a unit of its own) again in backward
    assert kept["gathers"] == [kept["units"]] * STEPS
    assert fsdp2["gathers"] == [kept["units"] + fsdp2["resharding_units"]] * STEPS


def test_kept_training_is_the_same_bits_as_fsdp2s_own(runs):
    fsdp2, kept = runs["fsdp2"], runs["kept"]
    assert kept["losses"] == fsdp2["losses"]
    for name, p in fsdp2["params"].items():
        assert torch.equal(kept["params"][name], p), name


def test_kept_storage_is_left_by_fsdp2s_free_only_when_marked():
    """The recipe's free_unsharded_param (torch before 2.15) frees an unmarked parameter's storage as
    FSDP2 does."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    was = FREE.installed()
    assert FREE.install()

    class _Param:
        free_unsharded_param = FSDPParam.free_unsharded_param
        if hasattr(FSDPParam, "free_all_gather_outputs"):  # torch 2.15: free_unsharded_param calls it
            free_all_gather_outputs = FSDPParam.free_all_gather_outputs

        def __init__(self, marked: bool):
            self.all_gather_outputs, self._unsharded_inner_tensors = [torch.ones(7)], []
            if marked:
                self.__dict__[KEPT] = True

    plain, marked = _Param(False), _Param(True)
    plain.free_unsharded_param()
    marked.free_unsharded_param()
    assert plain.all_gather_outputs[0].untyped_storage().size() == 0
    assert marked.all_gather_outputs[0].untyped_storage().size() == 7 * 4
    if not was:
        FREE.restore()
