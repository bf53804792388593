"""FSDP2 over 2 gloo ranks against the unsharded model, step for step, on the same global batches.

The ranks are spawned with a file:// rendezvous and a CPU device mesh, as PyTorch's own distributed
tests do; they run the project's real pieces (meta-device build, apply_fsdp, deterministic
materialisation, TokenBatches slicing, train_step) and rank 0 saves losses and full parameters.
"""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor, Replicate, Shard

from src.data.batches import TokenBatches
from src.distributed.env import build_mesh
from src.distributed.parallelize import apply_fsdp, materialize_and_init, mixed_precision_policy
from src.models.mini_llm.model import MiniLLM
from src.train.loop import train_step
from tests.support.ranks import spawn_ranks

MODEL = dict(vocab_size=97, dim=48, n_layers=2, n_heads=4, causal=True)
BATCH, SEQ, STEPS, SEED = 3, 17, 4, 7
WORLD = 2


def _optimizer(model):
    return torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)


def _sharded_rank(rank: int, init_file: str, out: str, strategy: str, param_dtype: str, layout: dict) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    model = opt = None
    try:
        with torch.device("meta"):
            model = MiniLLM(**MODEL)
        mesh = build_mesh("cpu", WORLD, strategy, replicate=2 if strategy == "hsdp" else 1)
        apply_fsdp(model, mesh, mixed_precision_policy(param_dtype, "float32"), **layout)
        materialize_and_init(model, torch.device("cpu"), SEED)
        placements = {n: repr(tuple(p.placements)) for n, p in model.named_parameters() if isinstance(p, DTensor)}
        n_params = sum(1 for _ in model.parameters())
        units = sorted(name for name, m in model.named_modules() if isinstance(m, FSDPModule))
        init = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        opt = _optimizer(model)
        dp_rank = rank
        batches = TokenBatches("random", MODEL["vocab_size"], BATCH, SEQ, SEED, dp_rank, WORLD)
        losses = []
        for _ in range(STEPS):
            x, y = next(batches)
            loss, _ = train_step(model, opt, x, y, grad_clip=1.0)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "params": full, "init": init, "placements": placements, "n_params": n_params, "units": units}, out)
    finally:
        # Everything that holds collectives' work or tensors goes before the group: a gloo work object
        # left to interpreter shutdown takes the GIL from a torn-down interpreter and aborts the rank
        # ("terminate called without an active exception", seen in CI; pytorch/pytorch#179291).
        del model, opt
        gc.collect()
        dist.destroy_process_group()


def _unsharded_reference() -> dict:
    torch.manual_seed(0)
    with torch.device("meta"):
        model = MiniLLM(**MODEL)
    materialize_and_init(model, torch.device("cpu"), SEED)
    init = {n: p.detach().clone() for n, p in model.named_parameters()}
    opt = _optimizer(model)
    batches = TokenBatches("random", MODEL["vocab_size"], BATCH * WORLD, SEQ, SEED, 0, 1)
    losses = []
    for _ in range(STEPS):
        x, y = next(batches)
        loss, _ = train_step(model, opt, x, y, grad_clip=1.0)
        losses.append(loss.item())
    return {"losses": losses, "init": init, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


def _run_sharded(tmp_path: Path, strategy: str, param_dtype: str, **layout) -> dict:
    """`layout`: apply_fsdp's keyword arguments (split_root)."""
    out = tmp_path / "rank0.pt"
    spawn_ranks(_sharded_rank, (str(tmp_path / "rdzv"), str(out), strategy, param_dtype, layout), WORLD)
    return torch.load(out, weights_only=True)  # tensors, floats and strings only: nothing is unpickled


@pytest.fixture(scope="module")
def reference() -> dict:
    return _unsharded_reference()


@pytest.mark.parametrize("strategy", ["fsdp2", "hsdp", "fsdp2_split_root"])
def test_fp32_sharded_training_equals_unsharded_within_float32_rounding(tmp_path, reference, strategy):
    # fsdp2_split_root: the embedding and head as units of their own (sharding.split_root)
    split_root = strategy.endswith("_split_root")
    strategy = strategy.removesuffix("_split_root")
    layout = dict(split_root=True) if split_root else {}
    got = _run_sharded(tmp_path, strategy, "float32", **layout)
    assert got["units"] == ["", *(["embed", "head"] if split_root else []), "layers.0", "layers.1"]
    # initial weights: each rank drew the full tensor and kept its shard, so bit-identical
    for name, ref in reference["init"].items():
        assert torch.equal(got["init"][name], ref), name
    # Only the summation order of the gradient reduction differs: a few float32 ulps.
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-6, atol=1e-6)
    assert got["params"].keys() == reference["params"].keys()
    for name, ref in reference["params"].items():
        torch.testing.assert_close(got["params"][name], ref, rtol=1e-5, atol=1e-6, msg=name)
    # every parameter is a DTensor sharded on dim 0 (replicated first on the hsdp outer dim)
    assert len(got["placements"]) == got["n_params"]
    want = (Shard(0),) if strategy == "fsdp2" else (Replicate(), Shard(0))
    assert set(got["placements"].values()) == {repr(want)}


def test_bf16_mixed_precision_tracks_the_fp32_unsharded_run(tmp_path, reference):
    got = _run_sharded(tmp_path, "fsdp2", "bfloat16")
    # bf16 compute keeps 8 mantissa bits: the loss agrees to ~1e-2 relative, and after 4 AdamW
    # steps of lr 1e-3 the weights (fp32 masters) to within a few update sizes.
    torch.testing.assert_close(torch.tensor(got["losses"]), torch.tensor(reference["losses"]), rtol=1e-2, atol=1e-2)
    for name, ref in reference["params"].items():
        torch.testing.assert_close(got["params"][name], ref, rtol=0, atol=4e-3, msg=name)


def test_initial_weights_follow_the_seed():
    with torch.device("meta"):
        a = MiniLLM(**MODEL)
    materialize_and_init(a, torch.device("cpu"), SEED)
    with torch.device("meta"):
        b = MiniLLM(**MODEL)
    materialize_and_init(b, torch.device("cpu"), SEED + 1)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        if "norm" not in name and "bias" not in name:
            assert not torch.equal(pa, pb), f"{name} ignores the seed"

