"""Streaming floors under the fused RMSNorm: kernels that move exactly its bytes, in its launch
shapes, with less of its arithmetic, timed beside its own forward and backward.

    python -m benchmarks.row_floors [--widths 2048 4096] [--rows 8192] [--once]

A torch copy of an op's bytes (benchmarks/kernel_configs.py's copy group) is one reference, but a
different launch: at 32 MB a torch copy chained streams at 2.5 TB/s where the norm's forward
reaches 3.5, so it bounds nothing. These kernels share the norm's grids, warps and pipelining and
drop one piece of work at a time, so what each piece costs reads off the difference:

- forward bytes (read x, write y), one program a row as the forward: `y = x * w`, no row sum;
- backward bytes (read x and dy, write dx): one program a row (no dw possible: a partial a row
  would be rows x N of fp32), and the backward's persistent grid (2 programs an SM, its row loop
  and stages, the rows dealt round-robin) with no row sum and no dw, then with the dw partials
  accumulated and stored, then RMSNorm's own backward kernel (row sum and dw partials) without and
  with the dw launch;
- the loop over consecutive rows in blocks of 4-32 rows, as many blocks as the rows take, handed
  to SMs as they free up, a dw partial a block: whether a fixed share a program costs a ragged end.

Each row is timed replayed from a CUDA graph after do_bench's L2 flush and chained over distinct
inputs (src/fusion/timing.py), and reported as TB/s of the bytes the norm must move
(src/fusion/cases.py), whatever more a floor moves, so TB/s orders the rows as their times do. `--once` runs each
kernel once at each width and prints nothing: the workload for `ncu -k regex:_stream|_rms_norm`.
"""
from __future__ import annotations

import argparse
import json

import torch
import triton
import triton.language as tl

from src.fusion.cases import make_case
from src.fusion.timing import chain_ms, graph_ms


@triton.jit
def _stream_rows(X, W, Y, N, BLOCK: tl.constexpr):
    """One program a row, as the norm's forward: y = x * w, no statistics."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(Y + row * N + cols, (x * w).to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _stream_rows2(X, DY, W, DX, N, BLOCK: tl.constexpr):
    """One program a row with backward's bytes: dx = x * dy * w."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    x = tl.load(X + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    dy = tl.load(DY + row * N + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(DX + row * N + cols, (x * dy * w).to(DX.dtype.element_ty), mask=mask)


@triton.jit
def _stream_persistent(X, DY, W, DX, DW_PARTIAL, M, N, rows_per_program, BLOCK: tl.constexpr, STAGES: tl.constexpr, DW: tl.constexpr, DEALT: tl.constexpr):
    """Backward's bytes in a row loop (STAGES-deep tl.range): dx = x * dy * w, and with DW the fp32
    partial sum of dy * x stored once. DEALT: backward's own loop, the rows dealt round-robin over
    the grid, last first; else rows_per_program consecutive rows a program (the blocks below)."""
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < N
    w = tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    start = (pid * rows_per_program).to(tl.int64)  # int64 before the stride multiply
    first = pid if DEALT else 0
    count = M if DEALT else tl.minimum(rows_per_program, M - start)
    stride = tl.num_programs(0) if DEALT else 1
    for i in tl.range(first, count, stride, num_stages=STAGES):
        offs = ((M - 1 - i) if DEALT else (start + i)) * N + cols
        x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(DX + offs, (x * dy * w).to(DX.dtype.element_ty), mask=mask)
        if DW:
            acc += dy * x
    if DW:
        tl.store(DW_PARTIAL + pid * N + cols, acc, mask=mask)


def cases(M: int, N: int) -> list[tuple[str, int, object]]:
    """(name, bytes it must move, make_run) for each kernel at M x N bf16; make_run builds one call
    on fresh tensors (chain_ms builds several). The floors take their block, warps, stages and grid
    from RMSNorm's own launch plans (bf16, no residual, PDL off), so they follow its settings."""
    import perflab_kernels.triton.rms_norm as rn

    device = torch.device("cuda")
    index = torch.cuda.current_device()
    _, fwd_meta, _ = rn._fwd_plan(M, N, 2, index, False, False)
    programs, _, bwd_meta, *_ = rn._bwd_plan(M, N, 2, index, False, False, False)
    block, fwd_warps, bwd_warps, stages = fwd_meta["BLOCK"], fwd_meta["num_warps"], bwd_meta["num_warps"], bwd_meta["STAGES"]
    case = make_case("rms_norm", [M, N])
    fwd_bytes, bwd_bytes = case.bytes_fwd(2), case.bytes_bwd(2)

    def tensors(n: int) -> list[torch.Tensor]:
        return [torch.randn(M, N, device=device, dtype=torch.bfloat16) for _ in range(n)]

    def make_fwd_floor():
        x, y = tensors(2)
        w = torch.randn(N, device=device, dtype=torch.bfloat16)
        return lambda: _stream_rows[(M,)](x, w, y, N, BLOCK=block, num_warps=fwd_warps)

    def make_fwd():
        (x,) = tensors(1)
        w = torch.randn(N, device=device, dtype=torch.bfloat16)
        return lambda: rn.rms_norm_forward(x, w, 1e-6)

    def make_bwd_rows():
        x, dy, dx = tensors(3)
        w = torch.randn(N, device=device, dtype=torch.bfloat16)
        return lambda: _stream_rows2[(M,)](x, dy, w, dx, N, BLOCK=block, num_warps=bwd_warps)

    def make_persistent(dw: bool):
        def make():
            x, dy, dx = tensors(3)
            w = torch.randn(N, device=device, dtype=torch.bfloat16)
            partial = torch.empty(programs, N, device=device, dtype=torch.float32)
            return lambda: _stream_persistent[(programs,)](x, dy, w, dx, partial, M, N, 0, BLOCK=block, STAGES=stages, DW=dw, DEALT=True, num_warps=bwd_warps)
        return make

    def make_blocks(rows_per_block: int, warps: int):
        def make():
            x, dy, dx = tensors(3)
            w = torch.randn(N, device=device, dtype=torch.bfloat16)
            blocks = triton.cdiv(M, rows_per_block)
            partial = torch.empty(blocks, N, device=device, dtype=torch.float32)
            return lambda: _stream_persistent[(blocks,)](x, dy, w, dx, partial, M, N, rows_per_block, BLOCK=block, STAGES=stages, DW=True, DEALT=False, num_warps=warps)
        return make

    def make_bwd(dw_launch: bool):
        def make():
            x, dy = tensors(2)
            w = torch.randn(N, device=device, dtype=torch.bfloat16)
            _, rstd, _ = rn.rms_norm_forward(x, w, 1e-6)
            if dw_launch:
                return lambda: rn.rms_norm_backward(dy, x, w, rstd)
            skipped, shipped = SkippedLaunch(), rn._launch_dw

            def run():
                rn._launch_dw = skipped
                try:
                    rn.rms_norm_backward(dy, x, w, rstd)
                finally:
                    rn._launch_dw = shipped
            return run
        return make

    return [
        ("fwd floor: one program a row, y = x * w", fwd_bytes, make_fwd_floor),
        ("fwd: RMSNorm's forward", fwd_bytes, make_fwd),
        ("bwd floor: one program a row, dx = x * dy * w", bwd_bytes, make_bwd_rows),
        (f"bwd floor: backward's grid ({programs} programs, {stages} stages), no row sum, no dw", bwd_bytes, make_persistent(False)),
        ("bwd floor: backward's grid, dw partials, no row sum", bwd_bytes, make_persistent(True)),
        *[(f"bwd floor: blocks of {r} rows, {wp} warps, a dw partial each, no row sum", bwd_bytes, make_blocks(r, wp))
          for r, wp in ((32, bwd_warps), (16, bwd_warps), (8, bwd_warps), (4, bwd_warps), (8, 4), (16, 4))],
        ("bwd: RMSNorm's backward kernel, dw launch left out", bwd_bytes, make_bwd(False)),
        ("bwd: RMSNorm's backward, both launches", bwd_bytes, make_bwd(True)),
    ]


class SkippedLaunch:
    """Stands in for a kernels/triton Launcher and launches nothing: a launch left out of a
    measurement (its outputs then wrong), to time what it costs."""

    def launch(self, *args) -> None:
        pass


def measure(widths: tuple[int, ...], rows: int) -> list[dict]:
    """Each case at each width, both timers; a row per case, printed as it is taken."""
    device = torch.device("cuda")
    out = []
    for N in widths:
        for name, nbytes, make in cases(rows, N):
            run = make()
            flushed = graph_ms(run, device)
            chained = chain_ms(make, device, nbytes)
            row = {"shape": f"{rows}x{N}", "kernel": name, "bytes": nbytes, "graph_ms": flushed, "tbs": nbytes / (flushed * 1e-3) / 1e12,
                   "chain_ms": chained, "chain_tbs": nbytes / (chained * 1e-3) / 1e12}
            print(json.dumps(row), flush=True)
            out.append(row)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--widths", type=int, nargs="+", default=[2048, 4096])
    ap.add_argument("--rows", type=int, default=8192)
    ap.add_argument("--once", action="store_true", help="run each kernel once per width (a profiler's workload), time nothing")
    args = ap.parse_args()
    if args.once:
        for N in args.widths:
            for _, _, make in cases(args.rows, N):
                make()()
        torch.cuda.synchronize()
        return
    rows = measure(tuple(args.widths), args.rows)
    print(f"\n{torch.cuda.get_device_name()}, bf16; TB/s of the bytes RMSNorm must move (src/fusion/cases.py), whatever a floor moves\n")
    print("| shape | kernel | graph ms | TB/s | chain ms | chain TB/s |\n|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['shape']} | {r['kernel']} | {r['graph_ms']:.4f} | {r['tbs']:.2f} | {r['chain_ms']:.4f} | {r['chain_tbs']:.2f} |")


if __name__ == "__main__":
    main()
