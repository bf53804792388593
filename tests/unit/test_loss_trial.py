"""kernels=auto's loss trial (src/fusion/trial.py): which loss each step runs, and the decision from
step timings given by a stub timer (a CPU test of the decision, not of the GPU)."""
from __future__ import annotations

import pytest

from src.fusion.trial import MARGIN, LossTrial, keep_pick


def fused(logits, targets):  # stands for the fused cross-entropy
    raise AssertionError("not called here")


class StubTimer:
    """Step times given in advance, per step: what CUDA events would have measured."""

    def __init__(self, ms: dict[int, float]):
        self.ms, self.timed = ms, []

    def begin(self, step: int) -> None:
        self.timed.append(step)

    def end(self, step: int) -> None:
        pass

    def elapsed_ms(self) -> dict[int, float]:
        return {s: self.ms[s] for s in self.timed}


def run_steps(trial: LossTrial, steps: int) -> list[dict | None]:
    """Steps 0 .. steps-1 as the trainer drives them: the loss, the timer around the step, then settle."""
    records = []
    for step in range(steps):
        trial.loss_at(step)
        trial.begin(step)
        trial.end(step)
        records.append(trial.settle(step))
    return records


def test_keep_pick_keeps_the_faster_and_a_tie():
    assert keep_pick([70.0, 71.0], [72.0, 73.0])
    assert keep_pick([72.0 * (1 + MARGIN)], [72.0])  # within the margin: the pick (and its memory saving) stays
    assert not keep_pick([73.0, 74.0], [72.0, 72.5])


def test_eager_once_then_abba():
    trial = LossTrial(fused, first=1, pairs=2, timer=StubTimer({}))
    assert trial.last == 5
    # step 0 (the run's first) runs the pick, step 1 eager's once untimed, then ABBA over steps 2-5
    assert [trial.loss_at(s) for s in range(0, 6)] == [fused, None, fused, None, None, fused]
    assert [s for s in range(0, 7) if trial.timed(s)] == [2, 3, 4, 5]


@pytest.mark.parametrize("fused_ms, eager_ms, kept, after", [
    ((74.0, 74.4), (73.0, 73.2), "eager", None),  # the fused loss's step 1.4% slower: eager's stays
    ((72.0, 72.2), (73.0, 73.4), "picked", fused),
])
def test_the_trial_decides_from_the_run_s_steps(fused_ms, eager_ms, kept, after):
    ms = {1: 500.0, 2: fused_ms[0], 3: eager_ms[0], 4: eager_ms[1], 5: fused_ms[1], 9: 1000.0}  # step 1: eager's first, slow
    timer = StubTimer(ms)
    trial = LossTrial(fused, first=1, pairs=2, timer=timer)
    records = run_steps(trial, 8)
    assert timer.timed == [2, 3, 4, 5]  # only the trial's timed steps: not eager's first
    assert records[:5] == [None] * 5 and records[6:] == [None, None]  # decided once, after step 5
    record = records[5]
    assert record["kept"] == kept and record["steps"] == [2, 5]
    assert record["picked_ms"] == list(fused_ms) and record["eager_ms"] == list(eager_ms)
    assert record["picked_median_ms"] == pytest.approx(sum(fused_ms) / 2)
    assert trial.loss_at(6) is after and trial.loss_at(100) is after


def test_the_head_trial_switches_between_the_fused_head_and_the_logits_with_a_loss_step_by_step():
    """auto's head trial: each arm is (loss_fn, loss_in_model), what the training step reads; the
    fused head (the loss in the model) against the logits and the fused cross-entropy."""
    head, logits = (None, True), (fused, False)
    timer = StubTimer({2: 70.0, 3: 74.0, 4: 73.8, 5: 70.2})
    trial = LossTrial(head, first=1, pairs=2, other=logits, names=("fused head", "logits, cross_entropy fused"), timer=timer)
    assert [trial.loss_at(s) for s in range(0, 6)] == [head, logits, head, logits, logits, head]
    record = run_steps(trial, 7)[5]
    assert record["kept"] == "picked" and record["kept_name"] == "fused head" and record["names"] == ["fused head", "logits, cross_entropy fused"]
    assert trial.loss_at(6) == head


def test_the_head_trial_keeps_the_fused_head_within_its_wider_margin():
    from src.fusion.trial import HEAD_MARGIN

    timer = StubTimer({2: 89.54, 3: 89.09, 4: 89.09, 5: 89.54})  # the fused head 0.5% slower: past MARGIN, within HEAD_MARGIN
    trial = LossTrial((None, True), first=1, pairs=2, other=(fused, False), names=("fused head", "logits"), margin=HEAD_MARGIN, timer=timer)
    loss = LossTrial(fused, first=1, pairs=2, timer=StubTimer({2: 89.54, 3: 89.09, 4: 89.09, 5: 89.54}))
    for t in (trial, loss):
        run_steps(t, 6)
    assert trial.kept and trial.loss_at(9) == (None, True)
    assert loss.kept is False and loss.loss_at(9) is None  # the loss trial's 0.5% margin lets the fused loss go
