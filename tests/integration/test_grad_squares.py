"""speed.norm_in_copy_in (src/speed/grad_squares.py): clipping's norm from the sums of squares the
one-rank copy-in leaves, against get_total_norm; what it refuses to count, and where it stays off.
The copy-in kernel's own sums: tests/integration/test_reduce_copy_in.py."""
from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from perflab_kernels.triton.chunk_cat import launch_checked  # noqa: E402
from src.config.compose import compose_config  # noqa: E402
from src.speed.grad_squares import SQUARES, GradSquares  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _written(squares: GradSquares, sizes=(6, 4)) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """A copy-in output of two gradients, recorded, and the gradients as FSDP2 hands them out (views)."""
    grads = [torch.arange(1, n + 1, dtype=torch.bfloat16, device=DEVICE) for n in sizes]
    out = torch.empty(sum(sizes), device=DEVICE)
    squares.record(out, launch_checked(grads, 1, out, squares=True))
    return out, list(out.split(list(sizes)))


def test_the_sums_count_only_gradients_the_copy_wrote_and_nothing_changed_since():
    squares = GradSquares()
    out, views = _written(squares)
    assert float(squares.local_squares(views)) == sum(i * i for i in range(1, 7)) + sum(i * i for i in range(1, 5))
    assert squares.local_squares([torch.ones(3, device=DEVICE)]) is None  # not written by the copy
    assert squares.local_squares(views[:1]) is None  # part of a buffer: its sum covers the rest too
    views[1].add_(1)  # what FSDP2 does to a gradient it accumulates into
    assert squares.local_squares(views) is None
    _, fresh = _written(squares)
    assert squares.local_squares(fresh) is not None
    squares.clear()
    assert squares.local_squares(fresh) is None


def test_writes_still_to_come_are_counted_and_no_more():
    """FSDP2's one-rank copy of the input onto itself (the output speed.one_rank_copies aliases) comes
    after the copy-in: recorded as one write still to come, the sums count after it and not before."""
    squares = GradSquares()
    grads = [torch.ones(5, dtype=torch.bfloat16, device=DEVICE)]
    out = torch.empty(5, device=DEVICE)
    squares.record(out, launch_checked(grads, 1, out, squares=True), later_writes=1)
    assert squares.local_squares([out]) is None
    out.copy_(out)
    assert float(squares.local_squares([out])) == 5.0
    out.copy_(out)
    assert squares.local_squares([out]) is None


def test_a_gradient_divide_factor_keeps_it_off(tmp_path):
    """With FSDP2 dividing the gradients in that one-rank copy the sums would be of other values: off."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from src.speed.grad_squares import divides_gradients

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        fully_shard(model[0], mesh=init_device_mesh("cpu", (1,)))
        fully_shard(model, mesh=init_device_mesh("cpu", (1,)))
        assert not divides_gradients(model)
        model[0].set_gradient_divide_factor(2.0)
        assert divides_gradients(model)
    finally:
        dist.destroy_process_group()


def test_the_norm_is_get_total_norms_and_falls_back_to_a_pass_where_the_sums_do_not_cover():
    squares = GradSquares()
    _, views = _written(squares, sizes=(2049, 7))
    views = [v.mul(0.01) for v in views]  # new tensors: fall back
    out, written = _written(squares, sizes=(2049, 7))
    want = torch.nn.utils.get_total_norm(written)
    assert squares.norm(written).item() == pytest.approx(want.item(), rel=1e-6)
    assert squares.local_squares(written) is None  # taken: cleared
    assert squares.norm(views).item() == pytest.approx(torch.nn.utils.get_total_norm(views).item(), rel=1e-6)


@pytest.mark.parametrize("overrides, line", [
    (["speed.norm_in_copy_in=on", "speed.reduce_copy_in=off"],
     "speed.norm_in_copy_in=on sums the gradient norm in speed.reduce_copy_in's kernel where speed.one_rank_copies makes its output "
     "the gradients, and speed.reduce_copy_in=off; set speed.reduce_copy_in=auto or on"),
    (["speed.norm_in_copy_in=on", "speed=torch"], "speed.reduce_copy_in=off; set speed.reduce_copy_in=auto or on"),
    (["speed.norm_in_copy_in=on", "speed.one_rank_copies=off"], "and speed.one_rank_copies=off; set speed.one_rank_copies=auto or on"),
    (["speed.norm_in_copy_in=on", "optim.grad_clip=0"], "speed.norm_in_copy_in=on gives clipping its norm, and optim.grad_clip=0 clips nothing"),
])
def test_what_cannot_run_is_refused_in_one_line(overrides, line):
    from src.speed.apply import refusal

    got = refusal(compose_config(overrides))
    assert got is not None and line in got
    assert refusal(compose_config(["speed.norm_in_copy_in=on"])) is None


def test_it_stays_off_beyond_one_rank_or_without_the_recipes_it_rides_on():
    from src.speed.apply import norm_in_copy_in

    cfg = compose_config(["speed.norm_in_copy_in=on"])
    try:
        assert norm_in_copy_in(cfg, ["reduce_copy_in", "one_rank_copies"], 1, main=False) and SQUARES.on
        assert not norm_in_copy_in(cfg, ["reduce_copy_in", "one_rank_copies"], 2, main=False) and not SQUARES.on
        assert not norm_in_copy_in(cfg, ["reduce_copy_in"], 1, main=False)
        assert norm_in_copy_in(compose_config([]), ["reduce_copy_in", "one_rank_copies"], 1, main=False)  # auto under speed=copies
        assert not norm_in_copy_in(compose_config(["speed=torch"]), ["reduce_copy_in", "one_rank_copies"], 1, main=False)
        assert not norm_in_copy_in(compose_config(["optim.grad_clip=0"]), ["reduce_copy_in", "one_rank_copies"], 1, main=False)
    finally:
        SQUARES.on = False


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run whose copy-in kernel runs in Triton's interpreter, "
                    "which a process on a GPU machine does not use")
def test_a_one_rank_run_clips_with_the_norm_from_the_copy_in(tmp_path, in_process_runs, monkeypatch):
    """A one-rank CPU run (the kernel in Triton's interpreter) with it on: every step's norm came from
    the copy-in's sums where the kernel took every unit's copy (torch 2.11-2.14; torch 2.15 hands it
    mixed bf16/fp32 groups, which go to FSDP2's own copy, and every step then sums its norm in a pass
    of its own), the recipe list says so, and the norms are those of the same run with it off (to
    fp32's rounding at the first step, the same gradients; after it a clipping factor a unit of fp32's
    last place apart can flip a bf16 rounding of the weights, and the runs drift as such runs do)."""
    import perflab_kernels.triton.chunk_cat as chunk_cat
    from tests.support.in_process import train_on_and_off

    taken, took = [], []
    local, takes = GradSquares.local_squares, chunk_cat.takes
    monkeypatch.setattr(GradSquares, "local_squares", lambda self, grads: taken.append(local(self, grads)) or taken[-1])
    monkeypatch.setattr(chunk_cat, "takes", lambda *a: took.append(takes(*a)) or took[-1])
    one = ["dist.nproc=1", "train.steps=3", "data.seq_len=32", "data.batch_size=2", "tracking=none", "train.progress=false",
           "speed.reduce_copy_in=on", "speed.one_rank_copies=on", "optim.grad_clip=0.1"]
    norms = {}
    for use, (summary, metrics) in train_on_and_off(tmp_path, one, "speed.norm_in_copy_in").items():
        assert ("norm_in_copy_in" in summary["speed_recipes"]) is (use == "on")
        norms[use] = [m["grad_norm"] for m in metrics]
    assert len(taken) == 3 and took
    if all(took):
        assert all(t is not None for t in taken)  # no step fell back to a pass of its own
    else:
        assert all(t is None for t in taken)
    assert not SQUARES.on  # the run with it off left the copy-in summing nothing
    assert min(norms["on"]) > 0.1  # every step clipped
    assert norms["on"][0] == pytest.approx(norms["off"][0], rel=1e-6)
    assert norms["on"] == pytest.approx(norms["off"], rel=1e-3)


def test_a_run_ending_leaves_the_copy_in_summing_nothing():
    """restore_all (every run's end, src/train/worker.py) turns the summing off and forgets the sums,
    so a later copy-in in the process (another run, a test) neither sums nor keeps its buffers."""
    from src.speed import restore_all

    out = torch.zeros(8)
    SQUARES.on = True
    SQUARES.record(out, torch.ones(2))
    assert SQUARES._outputs
    restore_all()
    assert not SQUARES.on and not SQUARES._outputs
