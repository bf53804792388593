"""benchmarks/row_floors.py: the streaming floors the row kernels are measured against."""
from __future__ import annotations

import pytest


def test_streaming_floors_compute_what_they_move():
    """benchmarks/row_floors.py's floors read every input and write every output they claim (a floor
    that skipped one would stream fewer bytes than it is charged with): each against torch, in
    Triton's interpreter on odd shapes, a last block shorter than the rest."""
    triton = pytest.importorskip("triton")
    import torch

    from benchmarks.row_floors import _stream_persistent, _stream_rows, _stream_rows2

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    M, N, block = 11, 100, 128
    x, dy = (torch.randn(M, N, device=device) for _ in range(2))
    w = torch.randn(N, device=device)
    y, dx = torch.empty_like(x), torch.empty_like(x)
    _stream_rows[(M,)](x, w, y, N, BLOCK=block)
    torch.testing.assert_close(y, x * w)
    _stream_rows2[(M,)](x, dy, w, dx, N, BLOCK=block)
    torch.testing.assert_close(dx, x * dy * w)
    for programs in (1, 3, 4):  # 11 rows in shares of 11, 4 and 3, or dealt round-robin
        for dealt in (False, True):
            per = triton.cdiv(M, programs)
            dx.zero_()
            partial = torch.zeros(programs, N, device=device)
            _stream_persistent[(programs,)](x, dy, w, dx, partial, M, N, per, BLOCK=block, STAGES=2, DW=True, DEALT=dealt)
            torch.testing.assert_close(dx, x * dy * w)
            torch.testing.assert_close(partial.sum(0), (dy * x).sum(0))
