"""kernels=auto's last word on the loss: a few steps of the run itself, the picked loss against
eager's, or the fused head + loss against the logits and the loss alone.

auto picks each candidate from timings of that op alone (src/fusion/measure.py). The fused
cross-entropy can time faster than eager's alone at the seed's shape yet make the seed's step slower:
its kernels save GPU time, and its Python forward and backward cost host time in a step whose host
path is already most of the GPU's. Which of the two wins depends on the step around the op, so the
run measures it: the loss is the one pick that can change from step to step (the loss function is
read at each step; modules and compiled blocks are fixed once sharded).

Step `first` runs eager's loss once, untimed: a loss's first step carries one-time costs (the
allocator growing for the fp32 logits the fused loss never holds), and the run's first step has
already run the pick. Then `pairs` pairs of steps run the picked loss and eager's in ABBA order, so
a drift over the trial weighs on both alike; each step is timed on the GPU by CUDA events around
it, so the time a host-bound step leaves the GPU waiting counts. Once the last trial step is queued
the run syncs once, every rank takes the slowest rank's medians (all ranks then keep the same
loss), and the pick stays where its median step is no more than MARGIN slower than eager's; after
that the kept loss runs every step.

The eager steps hold the logits the fused loss avoids (1.2 GB more at the seed's shape): a run that
fits only with the fused loss would run out of memory in them, which is one reason the trial runs
only when asked for (`kernels.loss_trial`).

The head trial is the same schedule between two ways of computing the step's loss that a model with
the fused head (kernels/triton/linear_cross_entropy.py) can take from step to step: the head and the
loss in one (the model is called with the targets; no logits exist), or the head's logits and then
the loss alone (the cross-entropy auto timed fastest alone). auto asks for it where the two timed
alike alone (src/fusion/measure.py head_contest): what the fused head saves in the step is the
logits' bytes and the peak they set, which an op timed alone does not show. The fused head stays on
a tie within HEAD_MARGIN, a wider one than the picked loss's (it holds much less memory).
"""
from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

# The pick also saves memory (the fused loss never holds fp32 logits), so a tie keeps it; the
# margin is about the spread of one step's time between neighbouring steps of one setting.
MARGIN = 0.005
HEAD_MARGIN = 0.03
"""The head trial's: the fused head holds none of the logits (gigabytes at a large vocabulary), and
early steps of a host-bound run measure both arms alike within a few percent while the run's later
steps part further (benchmarks/notes/2026-12-07-evening.md); so it stays unless more than this slower."""


def room(steps: int, pairs: int, first: int = 1) -> bool:
    """Whether a run of `steps` steps holds a trial of `pairs` pairs from step `first` (LossTrial.last before its end)."""
    return first + 2 * pairs < steps


def keep_pick(picked_ms: list[float], eager_ms: list[float], margin: float = MARGIN) -> bool:
    """Whether the pick stays: its median step no more than `margin` slower than eager's."""
    return statistics.median(picked_ms) <= statistics.median(eager_ms) * (1 + margin)


class CudaStepTimer:
    """GPU time of each timed step: a CUDA event before and after it, read once at the end."""

    def __init__(self):
        self.events: dict[int, tuple[torch.cuda.Event, torch.cuda.Event]] = {}

    def begin(self, step: int) -> None:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.events[step] = (start, torch.cuda.Event(enable_timing=True))

    def end(self, step: int) -> None:
        self.events[step][1].record()

    def elapsed_ms(self) -> dict[int, float]:
        torch.cuda.synchronize()
        return {step: start.elapsed_time(stop) for step, (start, stop) in self.events.items()}


@dataclass
class LossTrial:
    """The picked way of computing the loss (`picked`, e.g. the fused cross-entropy) against `other`
    (eager's, None, by default): `other` once at `first`, untimed, then `pairs` timed pairs of steps;
    `loss_at(step)` is what a step runs, `settle(step)` decides once all trial steps are queued and
    returns the record (None before and after). `names`: how the record and the log call the two."""

    picked: Any
    first: int
    pairs: int
    other: Any = None
    names: tuple[str, str] = ("fused", "eager")
    margin: float = MARGIN
    timer: object = field(default_factory=CudaStepTimer)
    kept: bool | None = None

    @property
    def last(self) -> int:
        return self.first + 2 * self.pairs

    def timed(self, step: int) -> bool:
        return self.kept is None and self.first < step <= self.last

    def runs_picked(self, step: int) -> bool:
        """ABBA over the timed steps: pair i runs the pick first where i is even, eager first where it is odd."""
        i, second = divmod(step - self.first - 1, 2)
        return (second == 0) == (i % 2 == 0)

    def loss_at(self, step: int) -> Any:
        if self.kept is None and step == self.first:
            return self.other  # once, untimed: its first step's one-time costs stay out of the trial
        if self.timed(step):
            return self.picked if self.runs_picked(step) else self.other
        return self.other if self.kept is False else self.picked

    def begin(self, step: int) -> None:
        if self.timed(step):
            self.timer.begin(step)

    def end(self, step: int) -> None:
        if self.timed(step):
            self.timer.end(step)

    def settle(self, step: int) -> dict | None:
        """After the last trial step is queued (`step` is that step): read the timings, agree
        across ranks, decide. Every rank must call it at the same step."""
        if self.kept is not None or step != self.last:
            return None
        ms = self.timer.elapsed_ms()
        picked = [ms[s] for s in sorted(ms) if self.runs_picked(s)]
        eager = [ms[s] for s in sorted(ms) if not self.runs_picked(s)]
        medians = torch.tensor([statistics.median(picked), statistics.median(eager)], dtype=torch.float64)
        if dist.is_initialized() and dist.get_world_size() > 1:
            device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() and dist.get_backend() == "nccl" else torch.device("cpu")
            medians = medians.to(device)
            dist.all_reduce(medians, op=dist.ReduceOp.MAX)  # the slowest rank's: every rank decides alike
            medians = medians.cpu()
        picked_median, eager_median = medians.tolist()
        self.kept = keep_pick([picked_median], [eager_median], self.margin)
        return {
            "steps": [self.first + 1, self.last], "pairs": self.pairs, "margin": self.margin,
            "picked_ms": picked, "eager_ms": eager,  # this rank's steps
            "picked_median_ms": picked_median, "eager_median_ms": eager_median,  # the slowest rank's
            "kept": "picked" if self.kept else "eager",
            "names": list(self.names), "kept_name": self.names[0] if self.kept else self.names[1],
        }
