"""The row kernels' view of their tensors: (rows, last dim) with unit column stride. Already 2-D
inputs (the kernel bench's, and a model's flattened tokens) pass through without a reshape call:
each torch call on the launch path costs host microseconds that a 20-us kernel cannot hide."""
from __future__ import annotations

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as a (rows, t.shape[-1]) tensor whose rows are contiguous (a view where it can be)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def as_shape(t2: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A row kernel's (rows, n) output back in the input's shape (no call when it already is)."""
    return t2 if t2.shape == shape else t2.reshape(shape)
