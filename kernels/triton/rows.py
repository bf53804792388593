"""The row kernels' view of their tensors: (rows, last dim) with unit column stride. A contiguous
input of any rank is handed to the kernel as it is (its rows are N apart), and already 2-D inputs
pass through: each torch call on the launch path costs host microseconds that a short kernel
cannot hide (a reshape there and back costs about a third of such a kernel's time)."""
from __future__ import annotations

import torch


def as_rows(t: torch.Tensor) -> torch.Tensor:
    """t as a (rows, t.shape[-1]) tensor whose rows are contiguous (a view where it can be)."""
    t2 = t if t.dim() == 2 else t.reshape(-1, t.shape[-1])
    return t2 if t2.stride(-1) == 1 else t2.contiguous()


def row_major(t: torch.Tensor) -> tuple[torch.Tensor, int, int, int]:
    """(t or its rows, rows, row length, row stride) for a row kernel. A contiguous t comes back as
    it is, of whatever rank; otherwise `as_rows(t)`. An output made by `torch.empty_like` of the
    tensor returned is contiguous, so its rows are `row length` apart."""
    n = t.shape[-1]
    if n and t.is_contiguous():
        return t, t.numel() // n, n, n
    t2 = as_rows(t)
    return t2, t2.shape[0], n, t2.stride(0)


def as_shape(t2: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """A row kernel's (rows, n) output back in the input's shape (no call when it already is)."""
    return t2 if t2.shape == shape else t2.reshape(shape)


def by_width(block: int, table: dict[int, int], below: int) -> int:
    """The value for the widest block in `table` not wider than `block` (`below` under them all):
    the row kernels' launch settings by row width."""
    widest, value = 0, below
    for b, v in table.items():  # a loop, not max(..., default=): Dynamo traces this inside compiled blocks
        if widest < b <= block:
            widest, value = b, v
    return value


def warps_for(block: int, table: dict[int, int]) -> int:
    """The warps for the widest block in `table` not wider than `block` (4 below them all): the
    row kernels' tables of warps by row width (enough loads in flight per row)."""
    return by_width(block, table, 4)
