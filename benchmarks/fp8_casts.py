"""The float8 casts of a mini_llm step, each at its own shape, against the copy ceiling.

    python -m benchmarks.fp8_casts [--tokens 8192] [--dim 2048] [--hidden 8192] [--layers 12]
        [--recipe rowwise_with_gw_tensorwise] [--sweep [rowwise] [transposed] [from] [dy]] [--out DIR]

kernels/triton/fp8_linear.py casts every operand of a block's float8 GEMMs: per linear, the input X
and the weight W rowwise in forward, the output's gradient dY rowwise and W^T tensorwise in
backward, and under rowwise_with_gw_tensorwise X^T and dY^T tensorwise for the grad-weight GEMM.
Those passes only move bytes (read bf16, or for X^T and dY^T the rowwise cast's e4m3, and write
e4m3 and a scale), so each is timed against what
its bytes allow: chained over distinct inputs (L2 as the step's previous kernel leaves it,
src/fusion/timing.py chain_ms) and replayed from a CUDA graph after do_bench's flush, with TB/s
of its bytes and the host's microseconds a call. The step's sum (every linear of every block)
says what the casts cost and what they could cost at the copy ceiling.

Each linear's forward and backward casts are also timed as the linear runs them, one after the
other (X^T straight after X's rowwise cast, which L2 may still hold part of), chained.

--sweep times the step's casts, pass by pass as the linears run them, under the launch settings
the module keeps as constants (the rowwise cast's rows a program and warps; the transposed cast's
tile, warps, walk, which tile is transposed, whether TMA moves the tiles, and what X^T and dY^T
are cast from; dY's cast over pieces and the one with SiLU's gradient), and prints the step's sum
for each: the module constants take the fastest.
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import perflab_kernels.triton.fp8_linear as fp8
from benchmarks.fp8_gemms import add_block_shape_args, block_linears
from src.distributed.float8 import TRITON_RECIPES
from src.fusion.timing import chain_ms, copy_ceiling_tbs, graph_ms, host_us_per_call


@dataclass(frozen=True)
class Cast:
    """One cast of one linear a step: `kind` rowwise or transposed, of a (rows, cols) bf16 operand."""

    linear: str
    operand: str   # X, W, dY
    kind: str      # rowwise, transposed
    rows: int
    cols: int
    after_rowwise: bool = False  # a transposed cast that follows the operand's rowwise cast (X^T, dY^T)
    act: str | None = None       # applied inside the cast (fp8_linear.ACTS: SiLU on down's X, SiLU's gradient on up's dY, reading U too)
    pieces: int = 1              # a rowwise cast read from this many tensors side by side (qkv's dY: dq, dk, dv)
    col_sum: bool = False        # a rowwise cast that also sums its columns (a bias's gradient)

    @property
    def from_e4m3(self) -> bool:
        """Whether this cast reads the rowwise cast's e4m3 bytes (fp8_linear.TRANSPOSE_FROM) instead of bf16."""
        return self.after_rowwise and fp8.TRANSPOSE_FROM == "e4m3"

    @property
    def nbytes(self) -> int:
        """Read its source once (bf16, or e4m3 and the rows' scales), write e4m3 once, plus the fp32
        scales written (a row's, or the repeated one)."""
        if self.kind == "rowwise":
            return self.rows * self.cols * (2 + 1 + (2 if self.act == "silu_grad" else 0)) + 4 * self.rows
        if self.from_e4m3:
            return self.rows * self.cols * (1 + 1) + 4 * (self.rows + self.cols)
        return self.rows * self.cols * (2 + 1) + 4 * self.cols


def linear_passes(tokens: int, dim: int, hidden: int, recipe: str, act_in_cast: bool = True) -> list[tuple[str, str, list[Cast]]]:
    """(linear, pass, its casts in the order Float8RowwiseLinearFunction runs them) for a block's
    linears: forward X rowwise (X^T right after it), W rowwise; backward dY rowwise (dY^T right
    after it), W^T. `act_in_cast`: the down projection's X casts apply SiLU (precision.fp8_act_in_cast),
    and, with the grad weight in float8, up's dY cast SiLU's gradient (the pair fold_mlp_activation
    makes). qkv's dY is cast from dq, dk and dv (split_forward), and the two biased linears' dY casts
    sum their columns."""
    gw_float8 = TRITON_RECIPES[recipe]
    passes = []
    for name, fan_in, fan_out in block_linears(dim, hidden):
        act = "silu" if act_in_cast and name == "down" else None
        dy_act = "silu_grad" if act_in_cast and gw_float8 and name == "up" else None
        forward = [Cast(name, "X", "rowwise", tokens, fan_in, act=act)] + ([Cast(name, "X", "transposed", tokens, fan_in, True, act)] if gw_float8 else [])
        backward = [Cast(name, "dY", "rowwise", tokens, fan_out, act=dy_act, pieces=3 if name == "qkv" else 1, col_sum=name in ("qkv", "out"))]
        backward += [Cast(name, "dY", "transposed", tokens, fan_out, True)] if gw_float8 else []
        passes += [(name, "forward", forward + [Cast(name, "W", "rowwise", fan_out, fan_in)]),
                   (name, "backward", backward + [Cast(name, "W", "transposed", fan_out, fan_in)])]
    return passes


def make_pass(casts: list[Cast], device: torch.device, seed: int = 0) -> Callable[[], object]:
    """The casts run in order on operands of their own: a transposed cast takes the rowwise cast's
    e4m3 output (for X^T and dY^T) and rows' inverse scales from the cast before it in the pass,
    or, with none (W^T in backward; a transposed cast timed alone), ones made beforehand (the
    linear saved W's scales in forward). Operands are each linear's own: casts of two linears in one
    pass read tensors of their own shapes."""
    g = torch.Generator(device=device).manual_seed(seed)
    operands: dict[tuple[str, str], torch.Tensor] = {}
    for c in casts:
        if (c.linear, c.operand) not in operands:
            operands[c.linear, c.operand] = torch.randn(c.rows, c.cols, generator=g, device=device, dtype=torch.bfloat16)
        if c.act == "silu_grad" and (c.linear, "U") not in operands:  # SiLU's input beside dY
            operands[c.linear, "U"] = torch.randn(c.rows, c.cols, generator=g, device=device, dtype=torch.bfloat16)
    # pieces as the step has them: tensors of their own, not views of one
    parts = {(c.linear, c.operand): [p.contiguous() for p in operands[c.linear, c.operand].chunk(c.pieces, -1)] for c in casts if c.pieces > 1}

    def rowwise_cast(c: Cast) -> tuple[torch.Tensor, torch.Tensor]:
        key = (c.linear, c.operand)
        if c.pieces > 1 or c.col_sum:
            return fp8.rowwise_e4m3_pieces(parts.get(key, [operands[key]]), c.col_sum)[:2]
        return fp8.rowwise_e4m3(operands[key], c.act, operands.get((c.linear, "U")))

    saved = {(c.linear, c.operand): rowwise_cast(c) for c in casts if c.kind == "rowwise"}
    saved.update({(c.linear, c.operand): fp8.rowwise_e4m3(operands[c.linear, c.operand], c.act) for c in casts if (c.linear, c.operand) not in saved})

    def run() -> None:
        rowwise = dict(saved)
        for c in casts:
            if c.kind == "rowwise":
                rowwise[c.linear, c.operand] = rowwise_cast(c)
            else:
                q, inv = rowwise[c.linear, c.operand]
                fp8.transposed_e4m3(operands[c.linear, c.operand], inv, c.act, w8=q if c.after_rowwise else None)
    return run


def time_pass(casts: list[Cast], device: torch.device, flushed: bool = True) -> dict:
    """Chained GPU us (and, with `flushed`, graph us after the flush and host us a call) and TB/s."""
    seeds = itertools.count()
    nbytes = sum(c.nbytes for c in casts)
    chained = chain_ms(lambda: make_pass(casts, device, next(seeds)), device, nbytes)
    row = {"chain_us": 1e3 * chained, "chain_tbs": nbytes / (chained * 1e-3) / 1e12}
    if flushed:
        call = make_pass(casts, device)
        ms = graph_ms(call, device)
        row.update(graph_us=1e3 * ms, graph_tbs=nbytes / (ms * 1e-3) / 1e12, host_us=host_us_per_call(call, device))
    return row


def measure(casts: list[Cast], device: torch.device) -> list[dict]:
    """Each cast alone."""
    rows = []
    for cast in casts:
        row = {"linear": cast.linear, "operand": cast.operand, "act": cast.act, "kind": cast.kind, "shape": [cast.rows, cast.cols], "bytes": cast.nbytes,
               **time_pass([cast], device)}
        print(f"{cast.linear:5s} {_operand(row):3s} {cast.kind:10s} {cast.rows}x{cast.cols}: chained {row['chain_us']:.1f} us "
              f"({row['chain_tbs']:.2f} TB/s), flushed {row['graph_us']:.1f} us, host {row['host_us']:.1f} us", flush=True)
        rows.append(row)
    return rows


def measure_passes(passes: list[tuple[str, str, list[Cast]]], device: torch.device) -> list[dict]:
    """Each linear's forward and backward casts as the linear runs them, chained."""
    rows = []
    for linear, name, casts in passes:
        row = {"linear": linear, "pass": name, "casts": [f"{c.operand} {c.kind}" for c in casts], "bytes": sum(c.nbytes for c in casts),
               **time_pass(casts, device, flushed=False)}
        print(f"{linear:5s} {name:8s} {', '.join(row['casts'])}: chained {row['chain_us']:.1f} us ({row['chain_tbs']:.2f} TB/s)", flush=True)
        rows.append(row)
    return rows


# The sweep's settings: the module constants each one sets. The transposed cast's tile and warps
# first, walking down; then, for the fastest of those, the walk and where the transpose happens.
ROWWISE_SETTINGS = [dict(ROWWISE_ROWS=rows, ROWWISE_WARPS=warps) for rows, warps in
                    [(1, {4096: 8}), (1, {2048: 8}), (1, {8192: 16}), (2, {4096: 8}), (2, {2048: 8}), (4, {2048: 8}), (4, {2048: 16})]]
TILES = [(64, 64), (32, 64), (64, 32), (128, 32), (32, 128), (128, 64), (64, 128), (128, 128)]
TRANSPOSE_TILES = [dict(TRANSPOSE_TILE=tile, TRANSPOSE_WARPS=warps, TRANSPOSE_OF="e4m3", TRANSPOSE_WALK="down", TRANSPOSE_TMA=False)
                   for tile, warps in itertools.product(TILES, [4, 8])]
# X^T and dY^T from the bf16 operand as before, then from the rowwise cast's bytes under each of
# that cast's tiles and warps and each transpose point (the walk as shipped: the rowwise cast wrote
# the last rows last)
FROM_SETTINGS = [dict(TRANSPOSE_FROM="input")] + [dict(TRANSPOSE_FROM="e4m3", FROM_E4M3_TILE=tile, FROM_E4M3_WARPS=warps, TRANSPOSE_OF=of)
                                                  for tile, warps, of in itertools.product(TILES, [4, 8], ["e4m3", "input"])]


# dY's casts of the backward pass's own kinds: the cast over pieces with column sums (programs an SM,
# pipeline stages, warps), then SiLU's gradient's warps
DY_SETTINGS = ([dict(SUM_PROGRAMS_PER_SM=p, SUM_STAGES=st, SUM_WARPS=w) for p, st, w in itertools.product([1, 2, 4, 8], [1, 2, 4], [4, 8, 16])]
               + [dict(SILU_GRAD_WARPS=w) for w in ({4096: 8}, {8192: 16}, {4096: 16}, {8192: 32}, {2048: 4})])


def transpose_orders(tile: dict) -> list[dict]:
    return [dict(tile, TRANSPOSE_OF=of, TRANSPOSE_WALK=walk, TRANSPOSE_TMA=tma)
            for tma, of, walk in itertools.product([False, True], fp8.TRANSPOSE_OFS, fp8.WALKS)]


def _label(setting: dict) -> str:
    return " ".join(f"{k.split('_', 1)[1].lower()}={v}" for k, v in setting.items())


def _step_under(setting: dict, kind: str, passes: list[tuple[str, str, list[Cast]]], device: torch.device, layers: int) -> dict:
    """The step's casts, pass by pass as the linears run them, chained, under `setting`."""
    shipped = {k: getattr(fp8, k) for k in setting}
    try:
        for k, v in setting.items():
            setattr(fp8, k, v)
        per_pass = {f"{linear} {name}": time_pass(casts, device, flushed=False)["chain_us"] for linear, name, casts in passes}
    finally:
        for k, v in shipped.items():
            setattr(fp8, k, v)
    step_ms = layers * sum(per_pass.values()) / 1e3
    nbytes = layers * sum(c.nbytes for _, _, casts in passes for c in casts)
    row = {"kind": kind, "setting": _label(setting), "constants": {k: repr(v) for k, v in setting.items()}, "step_ms": step_ms,
           "tbs": nbytes / (step_ms * 1e-3) / 1e12, "per_pass_us": per_pass, "shipped": setting == shipped}
    print(f"{kind:10s} {row['setting']:80s} {step_ms:.3f} ms a step ({row['tbs']:.2f} TB/s){'  (shipped)' if row['shipped'] else ''}", flush=True)
    return row


def sweep(passes: list[tuple[str, str, list[Cast]]], device: torch.device, layers: int, kinds: tuple[str, ...] = ("rowwise", "transposed")) -> list[dict]:
    """The step's chained ms under each setting of each kind of cast, the other kind as shipped."""
    results = [_step_under(s, "rowwise", passes, device, layers) for s in ROWWISE_SETTINGS] if "rowwise" in kinds else []
    if "transposed" in kinds:
        tiles = [_step_under(s, "transposed", passes, device, layers) for s in TRANSPOSE_TILES]
        best = TRANSPOSE_TILES[min(range(len(tiles)), key=lambda i: tiles[i]["step_ms"])]
        results += tiles + [_step_under(s, "transposed", passes, device, layers) for s in transpose_orders(best) if s != best]
    if "from" in kinds:
        results += [_step_under(s, "from", passes, device, layers) for s in FROM_SETTINGS]
    if "dy" in kinds:
        results += [_step_under(s, "dy", passes, device, layers) for s in DY_SETTINGS]
    return results


def _operand(row: dict) -> str:
    return row["operand"] + (f" ({row['act']})" if row.get("act") else "")


def table(rows: list[dict], passes: list[dict], layers: int, ceiling_tbs: float) -> str:
    lines = ["| linear | operand | cast | shape | MB | chained us (TB/s) | flushed us (TB/s) | host us |", "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['linear']} | {_operand(r)} | {r['kind']} | {r['shape'][0]}x{r['shape'][1]} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['chain_us']:.1f} ({r['chain_tbs']:.2f}) | {r['graph_us']:.1f} ({r['graph_tbs']:.2f}) | {r['host_us']:.1f} |")
    lines += ["", "| linear | pass | casts, in order | MB | chained us (TB/s) | its casts alone, chained us |", "|---|---|---|---:|---:|---:|"]
    alone = {(r["linear"], r["operand"], r["kind"]): r["chain_us"] for r in rows}
    for r in passes:
        own = sum(alone[(r["linear"], *c.split(" "))] for c in r["casts"])
        lines.append(f"| {r['linear']} | {r['pass']} | {', '.join(r['casts'])} | {r['bytes'] / 1e6:.1f} | {r['chain_us']:.1f} ({r['chain_tbs']:.2f}) | {own:.1f} |")
    nbytes = layers * sum(r["bytes"] for r in rows)
    chained = layers * sum(r["chain_us"] for r in rows) / 1e3
    in_passes = layers * sum(r["chain_us"] for r in passes) / 1e3
    flushed = layers * sum(r["graph_us"] for r in rows) / 1e3
    host = layers * sum(r["host_us"] for r in rows) / 1e3
    floor = nbytes / (ceiling_tbs * 1e12) * 1e3
    lines += ["", f"a step ({layers} blocks, {len(rows) * layers} casts, {nbytes / 1e9:.2f} GB): each cast alone chained {chained:.2f} ms "
              f"({nbytes / (chained * 1e-3) / 1e12:.2f} TB/s), flushed {flushed:.2f} ms, host {host:.2f} ms; as the linears run them "
              f"{in_passes:.2f} ms ({nbytes / (in_passes * 1e-3) / 1e12:.2f} TB/s); at the copy ceiling ({ceiling_tbs:.2f} TB/s) {floor:.2f} ms"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_block_shape_args(p)
    p.add_argument("--layers", type=int, default=12, help="blocks a step")
    p.add_argument("--recipe", default="rowwise_with_gw_tensorwise", choices=sorted(TRITON_RECIPES))
    p.add_argument("--sweep", nargs="*", choices=["rowwise", "transposed", "from", "dy"], default=None,
                   help="also time the step's casts under each launch setting of these kinds of cast (rowwise and transposed if none "
                        "is named; from: X^T and dY^T read from the bf16 operand or from the rowwise cast's bytes, fp8_linear.TRANSPOSE_FROM; "
                        "dy: the cast over pieces with column sums, and the cast with SiLU's gradient)")
    p.add_argument("--act-apart", action="store_true", help="the MLP's SiLU as a pass of its own (precision.fp8_act_in_cast=false): "
                   "the down projection's X casts without it")
    p.add_argument("--out", default=None, help="directory for casts.json (and sweep.json)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_casts times the float8 casts on an NVIDIA GPU; none is visible here")
    device = torch.device("cuda")
    passes = linear_passes(args.tokens, args.dim, args.hidden, args.recipe, not args.act_apart)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.recipe}, tokens {args.tokens}", flush=True)
    ceiling = copy_ceiling_tbs(device, 2**30)
    rows = measure([c for _, _, casts in passes for c in casts], device)
    pass_rows = measure_passes(passes, device)
    print(table(rows, pass_rows, args.layers, ceiling))
    results = sweep(passes, device, args.layers, tuple(args.sweep or ("rowwise", "transposed"))) if args.sweep is not None else []
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "casts.json").write_text(json.dumps({"ceiling_tbs": ceiling, "rows": rows, "passes": pass_rows}, indent=1))
        if results:
            Path(args.out, "sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
