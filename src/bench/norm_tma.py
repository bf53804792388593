"""RMSNorm forward and backward with TMA (tensor descriptor) loads and stores, against the shipped
pointer kernels, bf16 at 8192 x 2048 and 8192 x 4096: `python -m src.bench.norm_tma` (`check` runs the
kernels once on CPU-sized tensors against the shipped ones). Rows are viewed as (M, C, 256), so one
(1, C, 256) box is one row (a TMA box is at most 256 a dimension)."""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

import kernels.triton.rms_norm as rn

BOX = 256


@triton.jit
def _fwd_tma(x_desc, y_desc, W, RSTD, M, eps, C: tl.constexpr, STAGES: tl.constexpr):
    N: tl.constexpr = C * 256
    c = tl.arange(0, C)[:, None] * 256 + tl.arange(0, 256)[None, :]
    w = tl.load(W + c).to(tl.float32)[None, :, :]
    for row in tl.range(tl.program_id(0), M, tl.num_programs(0), num_stages=STAGES):
        x = x_desc.load([row, 0, 0]).to(tl.float32)
        rstd = 1.0 / tl.sqrt(tl.sum(tl.sum(x * x, axis=2), axis=1) / N + eps)
        tl.store(RSTD + row + tl.arange(0, 1), rstd)
        y_desc.store([row, 0, 0], (x * rstd[:, None, None] * w).to(tl.bfloat16))


@triton.jit
def _bwd_tma(dy_desc, x_desc, dx_desc, W, RSTD, DW_PARTIAL, M, rows_per_program, C: tl.constexpr, STAGES: tl.constexpr, STORE_TMA: tl.constexpr, DX):
    N: tl.constexpr = C * 256
    pid = tl.program_id(0)
    c = tl.arange(0, C)[:, None] * 256 + tl.arange(0, 256)[None, :]
    w = tl.load(W + c).to(tl.float32)[None, :, :]
    dw = tl.zeros((1, C, 256), dtype=tl.float32)
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for row in tl.range(start, end, num_stages=STAGES):
        x = x_desc.load([row, 0, 0]).to(tl.float32)
        dy = dy_desc.load([row, 0, 0]).to(tl.float32)
        rstd = tl.load(RSTD + row + tl.arange(0, 1))[:, None, None]
        x_hat = x * rstd
        wdy = w * dy
        s = tl.sum(tl.sum(wdy * x_hat, axis=2), axis=1) / N
        dx = rstd * (wdy - x_hat * s[:, None, None])
        if STORE_TMA:
            dx_desc.store([row, 0, 0], dx.to(tl.bfloat16))
        else:
            tl.store(DX + row * N + c[None, :, :], dx.to(tl.bfloat16))
        dw += dy * x_hat
    tl.store(DW_PARTIAL + pid * N + c, tl.sum(dw, axis=0))


@triton.jit
def _stream_tma(dy_desc, x_desc, dx_desc, W, M, rows_per_program, C: tl.constexpr, STAGES: tl.constexpr):
    """The backward's bytes through TMA, no row sum, no dw."""
    pid = tl.program_id(0)
    c = tl.arange(0, C)[:, None] * 256 + tl.arange(0, 256)[None, :]
    w = tl.load(W + c).to(tl.float32)[None, :, :]
    start = pid * rows_per_program
    end = tl.minimum(start + rows_per_program, M)
    for row in tl.range(start, end, num_stages=STAGES):
        x = x_desc.load([row, 0, 0]).to(tl.float32)
        dy = dy_desc.load([row, 0, 0]).to(tl.float32)
        dx_desc.store([row, 0, 0], (x * dy * w).to(tl.bfloat16))


def desc(t: torch.Tensor) -> TensorDescriptor:
    M, N = t.shape
    return TensorDescriptor(t, [M, N // BOX, BOX], [N, BOX, 1], [1, N // BOX, BOX])


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


def fwd_tma(x, w, eps, programs, stages, warps):
    M, N = x.shape
    y = torch.empty_like(x)
    rstd = torch.empty(M, dtype=torch.float32, device=x.device)
    _fwd_tma[(programs,)](desc(x), desc(y), w, rstd, M, eps, C=N // BOX, STAGES=stages, num_warps=warps)
    return y, rstd


def bwd_tma(dy, x, w, rstd, per_sm, stages, warps, store_tma=True, dw_launch=True):
    M, N = x.shape
    programs = min(M, sms() * per_sm)
    rows_per_program = triton.cdiv(M, programs)
    dx = torch.empty_like(x)
    partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    _bwd_tma[(programs,)](desc(dy), desc(x), desc(dx), w, rstd, partial, M, rows_per_program, C=N // BOX, STAGES=stages, STORE_TMA=store_tma, DX=dx, num_warps=warps)
    dw = torch.empty_like(w)
    if dw_launch:
        rn._launch_dw.launch((triton.cdiv(N, rn.DW_BLOCK_N),), (partial, dw, programs, N), dict(BLOCK_P=min(rn.DW_BLOCK_P, triton.next_power_of_2(programs)), BLOCK_N=rn.DW_BLOCK_N, USE_GDC=False, num_warps=4), None)
    return dx, dw


def check(M=37, N=512, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, device=device, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    y0, r0, _ = rn.rms_norm_forward(x, w, 1e-6)
    dx0, dw0 = rn.rms_norm_backward(dy, x, w, r0)
    out = {}
    for programs in (1, 5, M):
        y, r = fwd_tma(x, w, 1e-6, programs, 2, 4)
        out[f"fwd p{programs}"] = ((y.float() - y0.float()).abs().max().item(), (r - r0).abs().max().item())
    for per_sm, store in ((1, True), (2, False)):
        dx, dw = bwd_tma(dy, x, w, r0, per_sm, 2, 4, store)
        out[f"bwd {per_sm} {store}"] = ((dx.float() - dx0.float()).abs().max().item(), (dw.float() - dw0.float()).abs().max().item())
    print(json.dumps(out))


def measure():

    dev = torch.device("cuda")
    M = 8192
    for N in (2048, 4096):
        _width(M, N, dev)


def _width(M, N, dev):
    from src.fusion.cases import make_case
    from src.fusion.timing import chain_ms, graph_ms
    check(M, N, "cuda")
    case = make_case("rms_norm", [M, N])
    fb, bb = case.bytes_fwd(2), case.bytes_bwd(2)

    def t(n):
        return [torch.randn(M, N, device=dev, dtype=torch.bfloat16) for _ in range(n)]

    def W():
        return torch.randn(N, device=dev, dtype=torch.bfloat16)

    def row(name, nbytes, make, flushed=False):
        try:
            ch = chain_ms(make, dev, nbytes)
            g = graph_ms(make(), dev) if flushed else None
            print(json.dumps({"N": N, "kernel": name, "chain_us": round(ch * 1e3, 2), "chain_tbs": round(nbytes / (ch * 1e-3) / 1e12, 3),
                              "graph_us": round(g * 1e3, 2) if g else None}), flush=True)
            return ch
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"N": N, "kernel": name, "error": repr(e)[:300]}), flush=True)

    def m_fwd():
        (x,) = t(1)
        w = W()
        return lambda: rn.rms_norm_forward(x, w, 1e-6)

    def m_fwd_tma(p, st, wp):
        def make():
            (x,) = t(1)
            w = W()
            return lambda: fwd_tma(x, w, 1e-6, p, st, wp)
        return make

    def m_bwd():
        x, dy = t(2)
        w = W()
        _, r, _ = rn.rms_norm_forward(x, w, 1e-6)
        return lambda: rn.rms_norm_backward(dy, x, w, r)

    def m_bwd_tma(per_sm, st, wp, store=True, dwl=True):
        def make():
            x, dy = t(2)
            w = W()
            _, r, _ = rn.rms_norm_forward(x, w, 1e-6)
            return lambda: bwd_tma(dy, x, w, r, per_sm, st, wp, store, dwl)
        return make

    def m_stream(per_sm, st, wp):
        def make():
            x, dy, dx = t(3)
            w = W()
            programs = min(M, sms() * per_sm)
            rpp = triton.cdiv(M, programs)
            dd, xd, dxd = desc(dy), desc(x), desc(dx)
            return lambda: _stream_tma[(programs,)](dd, xd, dxd, w, M, rpp, C=N // BOX, STAGES=st, num_warps=wp)
        return make

    def m_both(f, b):
        def make():
            x, dy = t(2)
            w = W()
            return lambda: b(dy, x, w, f(x, w)[1])
        return make

    row("fwd shipped", fb, m_fwd, True)
    for p, st, wp in ((M, 1, 4), (M, 1, 8), (sms() * 2, 3, 4), (sms() * 4, 2, 4), (sms() * 4, 3, 4), (sms() * 8, 2, 4), (sms() * 2, 4, 8)):
        row(f"fwd tma programs={p} stages={st} warps={wp}", fb, m_fwd_tma(p, st, wp))
    row("bwd shipped (both launches)", bb, m_bwd, True)
    for per_sm, st, wp in ((1, 3, 4), (2, 3, 4), (2, 4, 4), (2, 2, 8), (2, 3, 8), (4, 2, 4), (4, 3, 4), (1, 4, 8), (8, 2, 4)):
        row(f"bwd stream floor tma per_sm={per_sm} stages={st} warps={wp}", bb, m_stream(per_sm, st, wp))
        row(f"bwd tma per_sm={per_sm} stages={st} warps={wp} (both launches)", bb, m_bwd_tma(per_sm, st, wp))
        row(f"bwd tma per_sm={per_sm} stages={st} warps={wp}, dx by pointer", bb, m_bwd_tma(per_sm, st, wp, False))
    row("fwd+bwd shipped", fb + bb, m_both(lambda x, w: rn.rms_norm_forward(x, w, 1e-6), lambda dy, x, w, r: rn.rms_norm_backward(dy, x, w, r)), True)


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        check()
    else:
        measure()
