"""The learning rate per step: `optim.schedule=constant` (the seed's) or `cosine` (linear warm-up
over `optim.warmup_steps`, then a half cosine down to `optim.min_lr_ratio * optim.lr` at the last
step: LLaMA's and torchtitan's shape). A function of the step alone, so a resumed run (any world
size) continues the same curve without the scheduler's state in the checkpoint."""
from __future__ import annotations

import math


def lr_at(step: int, lr: float, schedule: str, warmup_steps: int, total_steps: int, min_lr_ratio: float = 0.1) -> float:
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps  # step 0 trains at lr / warmup_steps, not at 0
    if schedule == "constant":
        return lr
    span = max(total_steps - warmup_steps - 1, 1)
    progress = min(max(step - warmup_steps, 0) / span, 1.0)
    return lr * (min_lr_ratio + (1 - min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))
