"""A rank entry for tests/integration/test_gpu.py's forkserver test: its module imports the trainer, as the
real entry's (src/train/worker.py) does, so the forkserver preloads the same modules."""
from __future__ import annotations

import os

import torch

import src.train.worker  # noqa: F401  (what the forkserver imports before forking a rank)


def matmul_on_gpu() -> tuple[int, float]:
    """(this rank's parent pid, one entry of a 2048 x 2048 matmul of ones on the GPU)."""
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count())
    a = torch.ones(2048, 2048, device=device)
    return os.getppid(), float((a @ a)[0, 0])
