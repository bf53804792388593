"""optim.in_backward over 2 gloo ranks: each FSDP unit updated from FSDP2's reduce-scatter hooks gives
the same losses and weights as the plain step, every unit is updated inside backward, and each
parameter exactly once a step."""
from __future__ import annotations

import gc
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from src.config.compose import ConfigError
from src.data.batches import TokenBatches
from src.distributed.env import build_mesh
from src.distributed.parallelize import apply_fsdp, materialize_and_init, mixed_precision_policy
from src.models.mini_llm import MiniLLM
from src.run import preflight
from src.train.loop import forward_backward_step, optimizer_step
from src.train.step_in_backward import StepInBackward, unit_parameters
from tests.spawned_ranks import spawn_ranks

MODEL = dict(vocab_size=97, dim=48, n_layers=2, n_heads=4, causal=True)
BATCH, SEQ, STEPS, SEED, WORLD = 3, 17, 4, 7, 2


def _train(in_backward: bool, split_root: bool) -> dict:
    with torch.device("meta"):
        model = MiniLLM(**MODEL)
    apply_fsdp(model, build_mesh("cpu", WORLD, "fsdp2", 1), mixed_precision_policy("float32", "float32"), split_root=split_root)
    materialize_and_init(model, torch.device("cpu"), SEED)
    # two groups (no decay for the norms) so the narrowed step keeps each group's own settings
    decay = [p for n, p in model.named_parameters() if p.ndim > 1]
    rest = [p for n, p in model.named_parameters() if p.ndim <= 1]
    opt = torch.optim.AdamW([{"params": decay}, {"params": rest, "weight_decay": 0.0}], lr=1e-2, weight_decay=0.1, foreach=True)
    stepper = StepInBackward(model, opt) if in_backward else None
    batches = TokenBatches("random", MODEL["vocab_size"], BATCH, SEQ, SEED, dist.get_rank(), WORLD)
    losses, in_bwd, steps_seen = [], [], []
    for _ in range(STEPS):
        x, y = next(batches)
        opt.zero_grad(set_to_none=True)
        # detached as train_step returns it: c10d's all_reduce on a tensor that requires grad goes
        # through autograd's not-implemented fallback, which registers a hook on the loss whose graph
        # backward has freed, and on torch 2.13 that segfaulted 1 run in 19 (gdb: VariableHooks::_register_hook)
        loss = forward_backward_step(model, x, y).detach()
        if stepper is not None:
            # what backward already updated: AdamW's per-parameter step count is 1 ahead there
            steps_seen.append(sorted({int(opt.state[p]["step"]) for p in model.parameters() if p in opt.state}))
        optimizer_step(model, opt, update=(lambda: in_bwd.append(stepper.finish())) if stepper else None, need_norm=False)
        dist.all_reduce(loss, op=dist.ReduceOp.AVG)
        losses.append(loss.item())
    counts = {int(opt.state[p]["step"]) for p in model.parameters()}
    full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    units = len(unit_parameters(model))
    if stepper is not None:
        stepper.remove()
    del opt, model
    gc.collect()
    return {"losses": losses, "params": full, "in_backward": in_bwd, "units": units, "counts": counts, "seen": steps_seen}


def _rank(rank: int, init_file: str, out: str, split_root: bool) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    try:
        got = {"plain": _train(False, split_root), "in_backward": _train(True, split_root)}
        if rank == 0:
            torch.save(got, out)
    finally:
        gc.collect()
        dist.destroy_process_group()


@pytest.mark.parametrize("split_root", [False, True], ids=["root_group", "split_root"])
def test_units_updated_in_backward_train_as_the_plain_step(tmp_path: Path, split_root: bool):
    out = tmp_path / "rank0.pt"
    spawn_ranks(_rank, (str(tmp_path / "rdzv"), str(out), split_root), WORLD)
    got = torch.load(out, weights_only=True)
    plain, early = got["plain"], got["in_backward"]
    # the root's group (embedding and head) and the two blocks; split root: the embedding and the head
    # as units of their own, the root left with no parameter of its own
    assert early["units"] == (4 if split_root else 3)
    # every unit's last gradient arrived through FSDP2's hook, so all were updated inside backward
    assert early["in_backward"] == [early["units"]] * STEPS
    # ... while backward ran: after step s's backward every parameter had been stepped s + 1 times
    assert early["seen"] == [[s + 1] for s in range(STEPS)]
    assert early["counts"] == plain["counts"] == {STEPS}  # each parameter once a step, no more
    # the same elementwise update per parameter: equal to float32 rounding
    torch.testing.assert_close(torch.tensor(early["losses"]), torch.tensor(plain["losses"]), rtol=1e-6, atol=1e-6)
    for name, ref in plain["params"].items():
        torch.testing.assert_close(early["params"][name], ref, rtol=1e-6, atol=1e-7, msg=name)


def test_finish_updates_what_backward_did_not():
    """No FSDP unit (no hook to wait for): finish() is the whole step, the same update as optimizer.step."""
    torch.manual_seed(0)
    a, b = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    b.load_state_dict(a.state_dict())
    opt_a, opt_b = torch.optim.AdamW(a.parameters(), lr=0.1), torch.optim.AdamW(b.parameters(), lr=0.1)
    stepper = StepInBackward(b, opt_b)
    assert stepper.units == []
    x = torch.randn(4, 5)
    for _ in range(2):
        for m, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            m(x).square().sum().backward()
        opt_a.step()
        assert stepper.finish() == 0
    for pa, pb in zip(a.parameters(), b.parameters(), strict=True):
        torch.testing.assert_close(pa, pb, rtol=0, atol=0)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["sharding=none", "optim.in_backward=true", "optim.grad_clip=0"], "optim.in_backward=true updates each FSDP unit when FSDP2 has reduced its gradients, and sharding=none has no FSDP units"),
        (["optim.in_backward=true"], "optim.grad_clip=1.0 cannot clip; set optim.grad_clip=0"),
        (["optim.in_backward=true", "optim.grad_clip=0", "train.nonfinite=skip"], "train.nonfinite=skip cannot skip a step; use train.nonfinite=fail"),
    ],
)
def test_in_backward_refuses_what_needs_the_norm_first(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(overrides, multirun=False)
    assert message in str(err.value)
