"""RMSNorm backward with rows dealt round-robin (program p takes rows p, p + P, ...) against the shipped
consecutive shares, with its streaming floor (no row sum, no dw), alone and after the forward:
`python -m src.bench.norm_round_robin` (`check`: once on CPU-sized tensors against the shipped kernels)."""
from __future__ import annotations

import json
import sys

import torch
import triton
import triton.language as tl

import kernels.triton.rms_norm as rn


@triton.jit
def _bwd_rr(DY, X, W, RSTD, DX, DW_PARTIAL, M, N, BLOCK: tl.constexpr, STAGES: tl.constexpr, ROWSUM: tl.constexpr, DW: tl.constexpr):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    col_mask = cols < N
    w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    dw = tl.zeros((BLOCK,), dtype=tl.float32)
    for row in tl.range(pid, M, tl.num_programs(0), num_stages=STAGES):
        offs = tl.full((1,), row, tl.int64) * N + cols
        x = tl.load(X + offs, mask=col_mask, other=0.0).to(tl.float32)
        dy = tl.load(DY + offs, mask=col_mask, other=0.0).to(tl.float32)
        rstd = tl.load(RSTD + row)
        x_hat = x * rstd
        wdy = w * dy
        if ROWSUM:
            dx = rstd * (wdy - x_hat * (tl.sum(wdy * x_hat, axis=0) / N))
        else:
            dx = wdy * x
        tl.store(DX + offs, dx.to(DX.dtype.element_ty), mask=col_mask)
        if DW:
            dw += dy * x_hat
    if DW:
        tl.store(DW_PARTIAL + pid * N + cols, dw, mask=col_mask)


def sms() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else 4


def bwd_rr(dy, x, w, rstd, per_sm, stages, warps, rowsum=True, dwk=True, dw_launch=True):
    M, N = x.shape
    programs = min(M, sms() * per_sm)
    dx = torch.empty_like(x)
    partial = torch.empty((programs, N), dtype=torch.float32, device=x.device)
    _bwd_rr[(programs,)](dy, x, w, rstd, dx, partial, M, N, BLOCK=triton.next_power_of_2(N), STAGES=stages, ROWSUM=rowsum, DW=dwk, num_warps=warps)
    dw = torch.empty_like(w)
    if dw_launch:
        rn._launch_dw.launch((triton.cdiv(N, rn.DW_BLOCK_N),), (partial, dw, programs, N), dict(BLOCK_P=min(rn.DW_BLOCK_P, triton.next_power_of_2(programs)), BLOCK_N=rn.DW_BLOCK_N, USE_GDC=False, num_warps=4), None)
    return dx, dw


def check(M=37, N=300, device="cpu"):
    torch.manual_seed(0)
    x = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    w = torch.randn(N, device=device, dtype=torch.bfloat16)
    dy = torch.randn(M, N, device=device, dtype=torch.bfloat16)
    _, r0, _ = rn.rms_norm_forward(x, w, 1e-6)
    dx0, dw0 = rn.rms_norm_backward(dy, x, w, r0)
    ref_dw = (dy.float() * x.float() * r0[:, None]).sum(0)
    out = {}
    for per_sm in (1, 2):
        dx, dw = bwd_rr(dy, x, w, r0, per_sm, 2, 4)
        out[f"rr {per_sm}"] = ((dx.float() - dx0.float()).abs().max().item(), (dw.float() - dw0.float()).abs().max().item(), (dw.float() - ref_dw).abs().max().item())
    print(json.dumps(out), flush=True)


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
        except Exception as e:  # noqa: BLE001
            print(json.dumps({"N": N, "kernel": name, "error": repr(e)[:300]}), flush=True)

    def m_bwd():
        x, dy = t(2)
        w = W()
        _, r, _ = rn.rms_norm_forward(x, w, 1e-6)
        return lambda: rn.rms_norm_backward(dy, x, w, r)

    def m_rr(per_sm, st, wp, rowsum=True, dwk=True, dwl=True):
        def make():
            x, dy = t(2)
            w = W()
            _, r, _ = rn.rms_norm_forward(x, w, 1e-6)
            return lambda: bwd_rr(dy, x, w, r, per_sm, st, wp, rowsum, dwk, dwl)
        return make

    def m_both(b):
        def make():
            x, dy = t(2)
            w = W()
            return lambda: b(dy, x, w, rn.rms_norm_forward(x, w, 1e-6)[1])
        return make

    row("bwd shipped (both launches)", bb, m_bwd, True)
    for per_sm, st, wp in ((2, 4, 8), (2, 3, 8), (2, 2, 8), (2, 4, 4), (3, 3, 8), (4, 2, 4), (4, 3, 4), (1, 4, 16), (8, 2, 4)):
        row(f"rr floor per_sm={per_sm} stages={st} warps={wp}: no row sum, no dw", bb, m_rr(per_sm, st, wp, False, False, False))
        row(f"rr per_sm={per_sm} stages={st} warps={wp}: kernel only", bb, m_rr(per_sm, st, wp, True, True, False))
        row(f"rr per_sm={per_sm} stages={st} warps={wp}: both launches", bb, m_rr(per_sm, st, wp))
    row("fwd+bwd shipped", fb + bb, m_both(lambda dy, x, w, r: rn.rms_norm_backward(dy, x, w, r)), True)
    for per_sm, st, wp in ((2, 4, 8), (2, 3, 8), (4, 2, 4)):
        row(f"fwd+bwd rr per_sm={per_sm} stages={st} warps={wp}", fb + bb, m_both(lambda dy, x, w, r, a=(per_sm, st, wp): bwd_rr(dy, x, w, r, *a)), True)


if __name__ == "__main__":
    if sys.argv[1:] == ["check"]:
        check()
    else:
        measure()
