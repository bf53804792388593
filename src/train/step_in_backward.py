"""AdamW's update of each FSDP unit as soon as FSDP2 has reduce-scattered its gradients (optim.in_backward).

FSDP2 calls a sharded parameter's post-accumulate-grad hooks right after it writes that parameter's
reduced gradient, inside the post-reduce stream's context (the reduce-scatter stream; hsdp's
all-reduce stream) in torch.distributed.fsdp's foreach_reduce, and records the event that the end
of backward waits on only after them. So a unit's update queued from the hook of its last
parameter runs on that stream while the compute stream goes on with the units backward still has
to do, instead of after all of backward on the compute stream. The next unit's reduce-scatter
queues behind it on the same stream, so an update takes the place of nothing but that stream's
idle time when it is shorter than a unit's backward. On the seed's step over 2 H200s the fused
AdamW of 367M fp32 parameters a GPU is 3.1 ms of kernels at the end of the step
(benchmarks/notes/PERFORMANCE.md 7); in backward only the units reduced last (the embedding, and the root's
group) are left there.

One optimizer keeps every parameter's state, so checkpoints, the learning-rate schedule and
`optim.impl` are those of the plain step: a unit's update is the optimizer's own `step()` over that
unit's parameters (its param_groups narrowed for the call, each group's current settings kept).
AdamW's update is elementwise per parameter, so it is the same update, unit by unit.
Needs what the global norm would hold back: no clipping, no skipping a non-finite step.
"""
from __future__ import annotations

import logging

import torch
import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

log = logging.getLogger("src.train")


def unit_parameters(model: nn.Module) -> list[list[nn.Parameter]]:
    """Each FSDP unit's own parameters (those no FSDP unit below it holds), children first."""
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    owned: dict[int, nn.Parameter] = {}
    out = []
    for unit in reversed(units):  # modules() lists parents first: children claim their parameters first
        mine = [p for p in unit.parameters() if id(p) not in owned]
        owned.update((id(p), p) for p in mine)
        if mine:
            out.append(mine)
    return out


class StepInBackward:
    """Hooks each unit's parameters; when the last of a unit's gradients arrives, steps the unit.

    `finish()` after backward steps whatever did not arrive whole (a unit with a parameter that got
    no gradient this step), so every parameter is updated exactly once a step either way; it
    returns how many units were stepped inside backward."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        self.optimizer = optimizer
        self.units = unit_parameters(model)
        self._needed = [sum(p.requires_grad for p in params) for params in self.units]
        self._arrived = [0] * len(self.units)
        self._stepped = [False] * len(self.units)
        self._in_backward = 0
        self.handles = []
        for i, params in enumerate(self.units):
            for p in params:
                if p.requires_grad:
                    self.handles.append(p.register_post_accumulate_grad_hook(lambda _p, i=i: self._arrive(i)))

    def _arrive(self, unit: int) -> None:
        self._arrived[unit] += 1
        if self._arrived[unit] == self._needed[unit]:
            self._step(self.units[unit])
            self._stepped[unit] = True
            self._in_backward += 1

    def _step(self, params: list[nn.Parameter]) -> None:
        ids = {id(p) for p in params}
        groups = self.optimizer.param_groups
        narrowed = [dict(g, params=[p for p in g["params"] if id(p) in ids]) for g in groups]
        self.optimizer.param_groups = [g for g in narrowed if g["params"]]
        try:
            self.optimizer.step()
        finally:
            self.optimizer.param_groups = groups

    def finish(self) -> int:
        """Step every parameter backward did not (the units whose gradients did not all arrive, and
        any parameter outside a unit); reset for the next step; return the count of units stepped
        inside backward."""
        done = {id(p) for i, params in enumerate(self.units) if self._stepped[i] for p in params}
        late = [p for g in self.optimizer.param_groups for p in g["params"] if id(p) not in done]
        if late:
            self._step(late)
        stepped = self._in_backward
        self._arrived = [0] * len(self.units)
        self._stepped = [False] * len(self.units)
        self._in_backward = 0
        return stepped

    def remove(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []
