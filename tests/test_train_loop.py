"""train_loop's contract with the step (CPU): which steps it reads, the grad norm only where it is
read, host queue time beside step time."""
from __future__ import annotations

import torch
import torch.nn as nn

from src.train.loop import LoopHooks, Throughput, forward_backward_step, optimizer_step, summarize, train_loop


def _run(log_every: int, steps: int, checkpoint_at: int | None = None, grad_clip: float = 0.0):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(1)
    batches = ((x, torch.roll(x, 1, 1)) for x in iter(lambda: torch.randint(0, 32, (4, 8), generator=gen), None))
    calls: list[tuple[int, bool, bool]] = []

    def step_fn(step, inputs, targets, read):
        opt.zero_grad(set_to_none=True)
        loss = forward_backward_step(model, inputs, targets)
        norm = optimizer_step(model, opt, grad_clip, need_norm=read)
        calls.append((step, read, norm is not None))
        return loss.detach(), norm

    result = train_loop(step_fn, opt, batches, steps, torch.device("cpu"), Throughput(32, 1, 1e3, None),
                        LoopHooks(checkpoint_due=lambda n: n == checkpoint_at), log_every=log_every)
    return result, calls


def test_the_loop_reads_every_nth_step_the_last_and_checkpoints_and_only_those_compute_a_norm():
    result, calls = _run(log_every=4, steps=10, checkpoint_at=6)
    read = [s for s, r, _ in calls if r]
    assert read == [3, 5, 7, 9]  # every 4th, the checkpoint after 6 steps, the last
    assert [s.step for s in result.steps] == read
    assert all(has_norm == r for _, r, has_norm in calls)
    assert all(s.grad_norm > 0 and s.host_step_time_s > 0 for s in result.steps)
    summary = summarize(result, untimed_steps=1)
    assert 0 < summary["host_step_time_s"] <= summary["step_time_s"] * 1.5


def test_clipping_needs_the_norm_on_every_step():
    _, calls = _run(log_every=4, steps=5, grad_clip=1.0)
    assert all(has_norm for _, _, has_norm in calls)


def test_the_unread_steps_train_the_same_weights():
    # skipping the norm changes nothing the optimizer does: the same losses as reading every step
    every, _ = _run(log_every=1, steps=6)
    sparse, _ = _run(log_every=3, steps=6)
    by_step = {s.step: s.loss for s in every.steps}
    assert all(by_step[s.step] == s.loss for s in sparse.steps)
