"""Launch settings of the fused kernels, swept on a GPU at the seed's shapes (bf16).

    python -m benchmarks.kernel_configs [--only adamw copy cross_entropy launch pdl rms_dw rms_fwd rms_norm rms_rows rms_parts rms_stages rms_wide softmax] [--out DIR]

Each setting is timed forward + backward from a CUDA graph (GPU time alone, L2 flushed between
replays) and as a chain over distinct inputs (L2 as the previous call left it, as in a step), so
the choice depends on the kernels, not on the host. Prints one table per kernel with
the effective TB/s of each setting; the module constants in kernels/triton/ take the winners.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from src.fusion.cases import forward_backward, make_case, seed, variant
from src.fusion.timing import chain_ms, graph_ms, host_us_per_call


def _fwd_bwd(op: str, shape: list[int], dtype=torch.bfloat16, forward_only: bool = False):
    """(run, leaves, bytes moved) for op at shape, forward + backward (or the forward alone)."""
    case = make_case(op, shape)
    seed("cuda")
    inputs = case.inputs(torch.device("cuda"), dtype, not forward_only)
    leaves = [t for t in inputs if t.requires_grad]
    fn = variant(op, "triton")
    size = torch.finfo(dtype).bits // 8
    if forward_only:
        return (lambda: fn(*inputs)), leaves, case.bytes_fwd(size)
    return forward_backward(fn, inputs), leaves, case.bytes_fwd(size) + case.bytes_bwd(size)


def _time(op: str, shape: list[int], forward_only: bool = False) -> dict:
    """Graph ms with L2 flushed (do_bench), chain ms over distinct inputs (L2 as a step leaves it:
    src/fusion/timing.py), their TB/s, and host us per call."""
    run, leaves, nbytes = _fwd_bwd(op, shape, forward_only=forward_only)
    device = torch.device("cuda")
    ms = graph_ms(run, device, grad_to_none=leaves)
    chained = chain_ms(lambda: _fwd_bwd(op, shape, forward_only=forward_only)[0], device, nbytes)
    return {"graph_ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12, "chain_ms": chained, "chain_tbs": nbytes / (chained * 1e-3) / 1e12,
            "host_us": host_us_per_call(run, device)}


GROUPS = ("adamw", "copy", "cross_entropy", "launch", "pdl", "rms_dw", "rms_fwd", "rms_norm", "rms_rows", "rms_parts", "rms_stages", "rms_wide", "softmax")


def adamw_rows(numels: list[int], device: torch.device, blocks: tuple[int, ...] = (2048, 1024, 512), updates: int = 16, warmup: int = 4) -> list[dict]:
    """The one-launch AdamW (kernels/triton/adamw.py) over parameters of `numels` (mini_llm's, from
    sweep()), fp32 and bf16 moments at each count of elements a pass: the median ms of `updates`
    updates run back to back (the grad norm's squares summed, the bf16 copies written, as the float8
    step runs it), and the TB/s of the bytes each moves."""
    import statistics

    import perflab_kernels.triton.adamw as aw

    params = [torch.randn(n, device=device) * 0.02 for n in numels]
    grads = [torch.randn(n, device=device) * 1e-3 for n in numels]
    copies = [torch.empty(n, device=device, dtype=torch.bfloat16) for n in numels]
    table = aw.TileTable(numels, device)
    bases = [i << aw.RAND_INDEX_BITS for i in range(len(numels))]
    saved, rows = dict(aw.BLOCKS), []
    for dtype in (torch.float32, torch.bfloat16):
        moments = [torch.zeros(n, device=device, dtype=dtype) for n in numels], [torch.zeros(n, device=device, dtype=dtype) for n in numels]
        moved = sum(numels) * (4 + 4 + 4 + 4 * dtype.itemsize + 2)  # parameter read + written, gradient, both moments, the copy
        for block in blocks:
            aw.BLOCKS[aw.STATE_DTYPES[dtype]] = block
            ms = []
            for step in range(1, warmup + updates + 1):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                aw.adamw_step_(params, grads, *moments, table, step=step, lr=1e-4, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
                               want_squares=True, copies=copies, rand_bases=bases, rounding_key=step)
                end.record()
                if step > warmup:
                    ms.append((start, end))
            torch.cuda.synchronize()
            med = statistics.median(a.elapsed_time(b) for a, b in ms)
            rows.append({"kernel": "adamw", "setting": f"moments={str(dtype).removeprefix('torch.')} block={block}", "shape": f"{sum(numels)}",
                         "graph_ms": None, "tbs": None, "chain_ms": med, "chain_tbs": moved / (med * 1e-3) / 1e12, "host_us": None})
            print(json.dumps(rows[-1]), flush=True)
        aw.BLOCKS.update(saved)
        del moments
    return rows


def _dw_reduce_rows(programs_per_sm: tuple[int, ...] = (2, 4), widths: tuple[int, ...] = (2048, 4096)) -> list[dict]:
    """RMSNorm backward's last step alone: the (programs x N) fp32 dw partials summed and rounded
    to bf16, torch's sum(0).to() (two launches) against the one-launch Triton reduction at a few
    tile shapes. Bytes: the partials read once, dw written once."""
    import triton

    import perflab_kernels.triton.rms_norm as rn
    from perflab_kernels.triton.device import sm_count

    device = torch.device("cuda")
    sms = sm_count(torch.cuda.current_device())
    rows = []
    for per_sm in programs_per_sm:
        for n in widths:
            partial = torch.randn(sms * per_sm, n, device=device)
            dw = torch.empty(n, device=device, dtype=torch.bfloat16)
            nbytes = partial.numel() * 4 + n * 2
            candidates = {"torch sum(0).to(bf16)": lambda p=partial: p.sum(0).to(torch.bfloat16)}
            for bp, bn in [(512, 16), (128, 16), (64, 32), (512, 8), (256, 8), (128, 8)]:
                candidates[f"triton block_p={bp} block_n={bn}"] = (
                    lambda p=partial, d=dw, n=n, bp=bp, bn=bn: rn._rms_norm_dw[(triton.cdiv(n, bn),)](p, d, p.shape[0], n, BLOCK_P=bp, BLOCK_N=bn, USE_GDC=False, num_warps=4))
            want = partial.sum(0).to(torch.bfloat16)
            for name, fn in candidates.items():
                fn()
                got = want if name.startswith("torch") else dw
                ok = torch.equal(got, want) or torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
                ms = graph_ms(fn, device)
                rows.append({"kernel": "rms_norm_dw", "setting": f"{name}{'' if ok else ' (WRONG)'}", "shape": f"{sms * per_sm}x{n}",
                             "graph_ms": ms, "tbs": nbytes / (ms * 1e-3) / 1e12, "host_us": host_us_per_call(fn, device)})
                print(json.dumps(rows[-1]), flush=True)
    return rows


class _Passthrough(torch.autograd.Function):
    """forward and backward that launch nothing: what any Python autograd.Function costs the host."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, dy):
        return dy


def _row(kernel: str, setting: str, shape, host_us: float | None, graph_ms: float | None = None, tbs: float | None = None) -> dict:
    """A row of the table (graph ms and TB/s None where nothing on the GPU is worth timing), printed as it is taken."""
    row = {"kernel": kernel, "setting": setting, "shape": "x".join(map(str, shape)), "graph_ms": graph_ms, "tbs": tbs, "host_us": host_us}
    print(json.dumps(row), flush=True)
    return row


def _python_function_floor(shape: tuple[int, int] = (8192, 2048)) -> list[dict]:
    """Host us of a forward + backward that launches nothing, through the same autograd.grad call
    as every row (a Python autograd.Function, and torch's own view op): the floor under any fused
    op's host cost as called, whatever its launches cost."""
    device = torch.device("cuda")
    x = torch.randn(shape, device=device, dtype=torch.bfloat16, requires_grad=True)
    return [_row("floor", setting, shape, host_us_per_call(forward_backward(fn, [x]), device))
            for setting, fn in (("python autograd.Function, no launch", _Passthrough.apply), ("torch view op, no launch", lambda t: t.view_as(t)))]


def _rms_norm_bodies(setting: str, shape: tuple[int, int] = (8192, 2048)) -> list[dict]:
    """Host us of RMSNorm's forward and backward launchers called directly on this thread, no
    autograd: what the fused op's own Python and launches cost, apart from the engine's."""
    import perflab_kernels.triton.rms_norm as rn

    device = torch.device("cuda")
    x = torch.randn(shape, device=device, dtype=torch.bfloat16)
    w = torch.ones(shape[1], device=device, dtype=torch.bfloat16)
    _, rstd, _ = rn.rms_norm_forward(x, w, 1e-6)
    return [_row("rms_norm", f"{setting} {part} launcher alone", shape, host_us_per_call(fn, device, calls=100))
            for part, fn in (("forward", lambda: rn.rms_norm_forward(x, w, 1e-6)), ("backward", lambda: rn.rms_norm_backward(x, x, w, rstd)))]


def _size_matched_copies() -> list[dict]:
    """The copy ceiling at each row op's own size: a torch copy moving the bytes forward moves, and
    copies moving those forward then backward move (one copy kernel each), timed as the ops are:
    replayed from a CUDA graph with L2 flushed, and chained over distinct buffers (chain_ms).
    The 4.25 TB/s ceiling is a 1 GB copy's; a copy of a sixteenth of that pays the same launch, ramp
    and last wave over a sixteenth of the time, and an op can hardly stream faster than a copy of
    its own bytes."""
    device = torch.device("cuda")
    rows = []
    for op, shape in [("rms_norm", [8192, 2048]), ("rms_norm", [8192, 4096]), ("add_rms_norm", [8192, 2048]),
                      ("softmax", [8192, 4096]), ("cross_entropy", [8192, 32000])]:
        case = make_case(op, shape)
        for what, parts in (("fwd bytes as 1 copy", [case.bytes_fwd(2)]), ("fwd+bwd bytes as 2 copies", [case.bytes_fwd(2), case.bytes_bwd(2)])):
            def make_copies(parts=parts):
                pairs = [(torch.empty(b // 4, dtype=torch.bfloat16, device=device), torch.empty(b // 4, dtype=torch.bfloat16, device=device)) for b in parts]
                for src, _ in pairs:
                    src.normal_()

                def run() -> None:
                    for src, dst in pairs:
                        dst.copy_(src)
                return run

            copies = make_copies()
            ms = graph_ms(copies, device)
            rows.append(_row("copy", what, shape, host_us_per_call(copies, device), ms, sum(parts) / (ms * 1e-3) / 1e12))
            ms = chain_ms(make_copies, device, sum(parts))
            rows.append(_row("copy", f"{what}, chained", shape, None, ms, sum(parts) / (ms * 1e-3) / 1e12))
    return rows


def sweep(groups: tuple[str, ...] = GROUPS) -> list[dict]:
    import perflab_kernels.triton.cross_entropy as ce
    import perflab_kernels.triton.rms_norm as rn
    import perflab_kernels.triton.softmax as sm

    rows: list[dict] = []
    if "adamw" in groups:
        from src.models.mini_llm.model import MiniLLM

        with torch.device("meta"):
            model = MiniLLM(vocab_size=32000, dim=2048, n_layers=12, n_heads=16)  # the seed's model: 98 parameters, 735M elements
        rows += adamw_rows([p.numel() for p in model.parameters()], torch.device("cuda"))

    def record(kernel: str, setting: str, op: str, shape: list[int]) -> None:
        try:
            r = _time(op.removesuffix("_fwd"), shape, forward_only=op.endswith("_fwd"))
        except Exception as err:  # a setting that does not compile (too many registers) is a row, not an end
            r = {"error": str(err).splitlines()[0][:120] if str(err) else type(err).__name__}
        rows.append({"kernel": kernel, "setting": setting, "shape": "x".join(map(str, shape)), **r})
        print(json.dumps(rows[-1]), flush=True)

    # fewer, wider programs hold fewer rows per SM: the second pass then re-reads its row from L2
    ce_settings = [(8192, 16, False), (4096, 8, False), (8192, 8, False), (16384, 16, False), (16384, 32, False), (4096, 16, False),
                   (32768, 16, True), (32768, 32, True)]
    saved_ce = ce.BLOCK_MAX, ce.NUM_WARPS, ce.ROW_IN_REGISTERS_MAX, ce.ROW_IN_REGISTERS_WARPS
    for block, warps, in_regs in ce_settings if "cross_entropy" in groups else ():
        ce.BLOCK_MAX, ce.NUM_WARPS = block, warps
        ce.ROW_IN_REGISTERS_MAX, ce.ROW_IN_REGISTERS_WARPS = (65536 if in_regs else 0), warps
        record("cross_entropy", f"block={block} warps={warps} row_in_registers={in_regs}", "cross_entropy", [8192, 32000])
    ce.BLOCK_MAX, ce.NUM_WARPS, ce.ROW_IN_REGISTERS_MAX, ce.ROW_IN_REGISTERS_WARPS = saved_ce

    if "copy" in groups:
        rows += _size_matched_copies()
    if "rms_dw" in groups:
        rows += _dw_reduce_rows()
    if "launch" in groups:  # host us per call: Triton's kernel[grid] against kernels/triton/launch.py's cache
        from perflab_kernels.triton import launch

        rows += _python_function_floor()
        try:
            for _ in range(2):  # twice, alternating: host times drift as the process warms
                for enabled in (False, True):
                    launch.ENABLED = enabled
                    rows += _rms_norm_bodies(f"cached_launch={enabled}")
                    for op, shape in [("rms_norm", [8192, 2048]), ("rms_norm_fwd", [8192, 2048]), ("add_rms_norm", [8192, 2048]),
                                      ("softmax", [8192, 4096]), ("swiglu", [8192, 11008]), ("cross_entropy", [8192, 32000])]:
                        record(op.removesuffix("_fwd"), f"cached_launch={enabled}{' forward' if op.endswith('_fwd') else ''}", op, shape)
        finally:
            launch.ENABLED = True
    if "pdl" in groups:  # programmatic dependent launch: each kernel placed while the one before it runs
        from perflab_kernels.triton import pdl

        saved_pdl = pdl.ENABLED, rn.DW_DEPENDENT
        norms = [("rms_norm", [8192, 2048]), ("add_rms_norm", [8192, 2048]), ("rms_norm", [8192, 4096])]
        others = [("rms_norm_fwd", [8192, 2048]), ("softmax", [8192, 4096]), ("cross_entropy", [8192, 32000])]
        for _ in range(2):  # twice, alternating: the difference is a few microseconds a kernel
            for enabled, dw_dependent in ((False, False), (False, True), (True, True)):
                pdl.ENABLED, rn.DW_DEPENDENT = enabled, dw_dependent
                for op, shape in norms + (others if dw_dependent else []):
                    record(op.removesuffix("_fwd"), f"pdl={enabled} dw_dependent={dw_dependent}", op, shape)
        pdl.ENABLED, rn.DW_DEPENDENT = saved_pdl
    fwd, fwd_residual, bwd, per_sm = dict(rn.FWD_WARPS), dict(rn.FWD_RESIDUAL_WARPS), dict(rn.BWD_WARPS), rn.BWD_PROGRAMS_PER_SM
    if "rms_stages" in groups:  # backward's row loop software-pipelined: the next rows' loads in flight
        saved_stages = rn.BWD_STAGES
        for stages, programs in [(4, 2), (1, 4), (3, 2), (5, 2), (6, 2), (4, 3), (5, 3)]:
            rn.BWD_STAGES, rn.BWD_PROGRAMS_PER_SM = {2048: stages, 4096: stages}, programs
            setting = f"bwd_stages={stages} bwd_programs_per_sm={programs}"
            record("rms_norm", setting, "rms_norm", [8192, 2048])
            record("add_rms_norm", setting, "add_rms_norm", [8192, 2048])
            record("rms_norm", setting, "rms_norm", [8192, 4096])
        rn.BWD_STAGES, rn.BWD_PROGRAMS_PER_SM = saved_stages, per_sm
    if "rms_fwd" in groups:  # forward: one program a tile, or a few per SM looping with their loads pipelined
        saved = rn.FWD_PROGRAMS_PER_SM, rn.FWD_STAGES, rn.FWD_ROWS
        for programs, stages, rows_ in [(0, 1, 1), (0, 1, 2), (2, 2, 1), (2, 3, 1), (4, 2, 1), (4, 3, 1), (8, 2, 1), (4, 2, 2), (2, 3, 2)]:
            rn.FWD_PROGRAMS_PER_SM, rn.FWD_STAGES, rn.FWD_ROWS = programs, stages, rows_
            setting = f"fwd_programs_per_sm={programs} fwd_stages={stages} fwd_rows={rows_}"
            record("rms_norm_fwd", setting, "rms_norm_fwd", [8192, 2048])
            record("rms_norm", setting, "rms_norm", [8192, 2048])
            record("add_rms_norm", setting, "add_rms_norm", [8192, 2048])
            record("rms_norm", setting, "rms_norm", [8192, 4096])
        rn.FWD_PROGRAMS_PER_SM, rn.FWD_STAGES, rn.FWD_ROWS = saved
    if "rms_rows" in groups:  # rows per tile: more loads in flight per program
        saved_rows = rn.FWD_ROWS, rn.BWD_ROWS
        for fr, br, programs, warps in [(1, 1, 4, 8), (2, 1, 4, 8), (4, 1, 4, 8), (2, 1, 4, 16), (4, 1, 4, 16),
                                        (1, 2, 4, 8), (1, 4, 4, 8), (1, 2, 2, 16), (1, 4, 2, 16), (1, 8, 1, 16), (1, 4, 1, 16)]:
            rn.FWD_ROWS, rn.BWD_ROWS, rn.BWD_PROGRAMS_PER_SM = fr, br, programs
            rn.FWD_WARPS, rn.BWD_WARPS = {2048: warps, 8192: 16}, {2048: warps, 8192: 16}
            rn.FWD_RESIDUAL_WARPS = rn.FWD_WARPS
            setting = f"fwd_rows={fr} bwd_rows={br} bwd_programs_per_sm={programs} warps={warps}"
            record("rms_norm", setting, "rms_norm", [8192, 2048])
            record("add_rms_norm", setting, "add_rms_norm", [8192, 2048])
            record("rms_norm_fwd", setting, "rms_norm_fwd", [8192, 2048])
        rn.FWD_ROWS, rn.BWD_ROWS, rn.BWD_PROGRAMS_PER_SM = *saved_rows, per_sm
        rn.FWD_WARPS, rn.FWD_RESIDUAL_WARPS, rn.BWD_WARPS = fwd, fwd_residual, bwd
    if "rms_parts" in groups:  # what backward's dw launch costs: the same forward + backward with it left out (dw then wrong)
        from benchmarks.row_floors import SkippedLaunch

        dw_launch = rn._launch_dw
        for shape in ([8192, 2048], [8192, 4096]):
            for skip in (False, True, False, True):
                rn._launch_dw = SkippedLaunch() if skip else dw_launch
                record("rms_norm", "dw launch left out (measurement only)" if skip else "as shipped", "rms_norm", shape)
        rn._launch_dw = dw_launch
    if "rms_wide" in groups:  # forward warps at 2048 and 4096, and 4096-wide rows' (LLaMA-7B's width) own backward grid
        saved = rn.FWD_ROWS, rn.BWD_STAGES
        for width in (2048, 4096):  # the forward alone, by warps at each width (the other widths' warps as shipped)
            for warps, rows_ in [(8, 1), (4, 1), (2, 1), (16, 1), (4, 2), (8, 2)]:
                rn.FWD_WARPS, rn.FWD_ROWS = {**fwd, width: warps}, rows_
                record("rms_norm_fwd", f"fwd_warps@{width}={warps} fwd_rows={rows_}", "rms_norm_fwd", [8192, width])
                if width == 2048 and rows_ == 1:
                    rn.FWD_RESIDUAL_WARPS = {**fwd_residual, width: warps}
                    record("add_rms_norm_fwd", f"fwd_residual_warps@{width}={warps}", "add_rms_norm_fwd", [8192, width])
                    rn.FWD_RESIDUAL_WARPS = fwd_residual
        rn.FWD_WARPS, rn.FWD_ROWS = fwd, saved[0]
        for warps, programs, stages in [(8, 2, 4), (16, 2, 4), (8, 1, 4), (16, 1, 4), (8, 3, 3), (8, 2, 3), (8, 2, 2), (16, 1, 6), (4, 4, 2), (4, 2, 4)]:
            rn.BWD_WARPS, rn.BWD_PROGRAMS_PER_SM, rn.BWD_STAGES = {**bwd, 4096: warps}, programs, {**saved[1], 4096: stages}
            record("rms_norm", f"bwd_warps@4096={warps} bwd_programs_per_sm={programs} bwd_stages={stages}", "rms_norm", [8192, 4096])
        rn.BWD_WARPS, rn.BWD_PROGRAMS_PER_SM, rn.BWD_STAGES = bwd, per_sm, saved[1]
    for fw in (2, 4, 8, 16) if "rms_norm" in groups else ():
        for bw in (4, 8, 16):
            rn.FWD_WARPS, rn.BWD_WARPS = {2048: fw, 8192: fw}, {2048: bw, 8192: bw}
            rn.FWD_RESIDUAL_WARPS = rn.FWD_WARPS
            record("rms_norm", f"fwd_warps={fw} bwd_warps={bw}", "rms_norm", [8192, 2048])
            record("add_rms_norm", f"fwd_warps={fw} bwd_warps={bw}", "add_rms_norm", [8192, 2048])
    rn.FWD_WARPS, rn.FWD_RESIDUAL_WARPS, rn.BWD_WARPS = fwd, fwd_residual, bwd
    for programs in (1, 2, 4, 8) if "rms_norm" in groups else ():
        rn.BWD_PROGRAMS_PER_SM = programs
        record("rms_norm", f"bwd_programs_per_sm={programs}", "rms_norm", [8192, 2048])
    rn.BWD_PROGRAMS_PER_SM = per_sm
    for fw in (4, 8, 16, 32) if "rms_norm" in groups else ():
        rn.FWD_WARPS, rn.BWD_WARPS = {2048: fw, 4096: fw}, {2048: fw, 4096: fw}
        record("rms_norm", f"warps={fw}", "rms_norm", [8192, 4096])
    rn.FWD_WARPS, rn.BWD_WARPS = fwd, bwd

    launch = sm._launch
    for warps in (4, 8, 16, 32) if "softmax" in groups else ():
        sm._launch = lambda n, w=warps: (launch(n)[0], w)
        record("softmax", f"warps={warps}", "softmax", [8192, 4096])
    sm._launch = launch
    saved_sm = sm.PROGRAMS_PER_SM, sm.STAGES
    for programs, stages in [(0, 1), (2, 2), (2, 3), (4, 2), (4, 3), (8, 2)] if "softmax" in groups else ():
        sm.PROGRAMS_PER_SM, sm.STAGES = programs, stages
        record("softmax", f"programs_per_sm={programs} stages={stages}", "softmax", [8192, 4096])
    sm.PROGRAMS_PER_SM, sm.STAGES = saved_sm

    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", nargs="+", choices=GROUPS, default=list(GROUPS), help="which sweeps to run")
    ap.add_argument("--out", type=Path, default=Path("bench_out/kernel_configs"))
    args = ap.parse_args()
    rows = sweep(tuple(args.only))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernel_configs.json").write_text(json.dumps(rows, indent=1))
    print(f"\n{torch.cuda.get_device_name()}, bf16, forward + backward replayed from a CUDA graph (L2 flushed) and chained over distinct inputs\n")
    print("| kernel | shape | setting | graph ms | TB/s | chain ms | chain TB/s | host us |\n|---|---|---|---:|---:|---:|---:|---:|")

    def num(value, digits: int) -> str:
        return "-" if value is None else f"{value:.{digits}f}"

    for r in rows:
        if "error" in r:
            print(f"| {r['kernel']} | {r['shape']} | {r['setting']} | failed: {r['error']} | | | | |")
        else:
            print(f"| {r['kernel']} | {r['shape']} | {r['setting']} | {num(r['graph_ms'], 4)} | {num(r['tbs'], 2)} | "
                  f"{num(r.get('chain_ms'), 4)} | {num(r.get('chain_tbs'), 2)} | {num(r['host_us'], 1)} |")


if __name__ == "__main__":
    main()
