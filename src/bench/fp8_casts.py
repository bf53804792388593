"""The float8 casts of a mini_llm step, each at its own shape, against the copy ceiling.

    python -m src.bench.fp8_casts [--tokens 8192] [--dim 2048] [--hidden 8192] [--layers 12]
        [--recipe rowwise_with_gw_tensorwise] [--sweep] [--out DIR]

kernels/triton/fp8_linear.py casts every operand of a block's float8 GEMMs: per linear, the input X
and the weight W rowwise in forward, the output's gradient dY rowwise and W^T tensorwise in
backward, and under rowwise_with_gw_tensorwise X^T and dY^T tensorwise for the grad-weight GEMM.
Those passes only move bytes (read bf16, write e4m3 and a scale), so each is timed against what
its bytes allow: chained over distinct inputs (L2 as the step's previous kernel leaves it,
src/fusion/timing.py chain_ms) and replayed from a CUDA graph after do_bench's flush, with TB/s
of its bytes and the host's microseconds a call. The step's sum (every linear of every block)
says what the casts cost and what they could cost at the copy ceiling.

--sweep times the step's casts under the launch settings the module keeps as constants (the
rowwise cast's rows a program and warps, the transposed cast's tile, warps and whether the tile is
transposed before or after the cast), chained, and prints the step's sum for each: the module
constants take the fastest.
"""
from __future__ import annotations

import argparse
import itertools
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

import kernels.triton.fp8_linear as fp8
from src.bench.fp8_gemms import block_linears
from src.fusion.timing import chain_ms, copy_ceiling_tbs, graph_ms, host_us_per_call


@dataclass(frozen=True)
class Cast:
    """One cast of one linear a step: `kind` rowwise or transposed, of a (rows, cols) bf16 operand."""

    linear: str
    operand: str   # X, W, dY
    kind: str      # rowwise, transposed
    rows: int
    cols: int

    @property
    def nbytes(self) -> int:
        """Read bf16 once, write e4m3 once, plus the fp32 scales (a row's, or the repeated one)."""
        scales = self.rows if self.kind == "rowwise" else self.cols
        return self.rows * self.cols * (2 + 1) + 4 * scales


def step_casts(tokens: int, dim: int, hidden: int, recipe: str) -> list[Cast]:
    """A block's casts in the order a step runs them (forward, then backward)."""
    gw_float8 = fp8_recipes()[recipe]
    forward, backward = [], []
    for name, fan_in, fan_out in block_linears(dim, hidden):
        forward += [Cast(name, "X", "rowwise", tokens, fan_in), Cast(name, "W", "rowwise", fan_out, fan_in)]
        if gw_float8:
            forward.append(Cast(name, "X", "transposed", tokens, fan_in))
        backward.append(Cast(name, "dY", "rowwise", tokens, fan_out))
        if gw_float8:
            backward.append(Cast(name, "dY", "transposed", tokens, fan_out))
        backward.append(Cast(name, "W", "transposed", fan_out, fan_in))
    return forward + backward


def fp8_recipes() -> dict[str, bool]:
    from src.distributed.float8 import TRITON_RECIPES

    return dict(TRITON_RECIPES)


def make_call(cast: Cast, device: torch.device, seed: int = 0) -> Callable[[], object]:
    """One call of the cast on inputs of its own: a rowwise cast as the linear calls it, a
    transposed one with the rows' inverse scales its rowwise cast left (the linear has them)."""
    g = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn(cast.rows, cast.cols, generator=g, device=device, dtype=torch.bfloat16)
    if cast.kind == "rowwise":
        return lambda: fp8.rowwise_e4m3(x)
    _, row_inv = fp8.rowwise_e4m3(x)
    return lambda: fp8.transposed_e4m3(x, row_inv)


def time_cast(cast: Cast, device: torch.device, flushed: bool = True) -> dict:
    """Chained GPU us (and, with `flushed`, graph us after the flush and host us a call) and TB/s."""
    seeds = itertools.count()
    chained = chain_ms(lambda: make_call(cast, device, next(seeds)), device, cast.nbytes)
    row = {"chain_us": 1e3 * chained, "chain_tbs": cast.nbytes / (chained * 1e-3) / 1e12}
    if flushed:
        call = make_call(cast, device)
        ms = graph_ms(call, device)
        row.update(graph_us=1e3 * ms, graph_tbs=cast.nbytes / (ms * 1e-3) / 1e12, host_us=host_us_per_call(call, device))
    return row


def measure(casts: list[Cast], device: torch.device) -> list[dict]:
    rows = []
    for cast in casts:
        row = {"linear": cast.linear, "operand": cast.operand, "kind": cast.kind, "shape": [cast.rows, cast.cols], "bytes": cast.nbytes,
               **time_cast(cast, device)}
        print(f"{cast.linear:5s} {cast.operand:3s} {cast.kind:10s} {cast.rows}x{cast.cols}: chained {row['chain_us']:.1f} us "
              f"({row['chain_tbs']:.2f} TB/s), flushed {row['graph_us']:.1f} us, host {row['host_us']:.1f} us", flush=True)
        rows.append(row)
    return rows


# The sweep's settings: the module constants each one sets.
ROWWISE_SETTINGS = [dict(ROWWISE_ROWS=rows, ROWWISE_WARPS=warps) for rows, warps in
                    [(1, {4096: 8}), (1, {2048: 8}), (1, {8192: 16}), (2, {4096: 8}), (2, {2048: 8}), (4, {2048: 8}), (4, {2048: 16})]]
TRANSPOSE_SETTINGS = [dict(TRANSPOSE_TILE=tile, TRANSPOSE_WARPS=warps, TRANSPOSE_FIRST=first) for tile, warps, first in
                      itertools.product([(64, 64), (128, 64), (64, 128), (128, 128)], [4, 8], [False, True])]


def _label(setting: dict) -> str:
    return " ".join(f"{k.split('_', 1)[1].lower()}={v}" for k, v in setting.items())


def sweep(casts: list[Cast], device: torch.device, layers: int) -> list[dict]:
    """The step's chained us under each setting of each kind of cast, the others as shipped."""
    results = []
    for kind, settings in (("rowwise", ROWWISE_SETTINGS), ("transposed", TRANSPOSE_SETTINGS)):
        chosen = [c for c in casts if c.kind == kind]
        shipped = {k: getattr(fp8, k) for k in settings[0]}
        try:
            for setting in settings:
                for k, v in setting.items():
                    setattr(fp8, k, v)
                per_cast = {f"{c.linear} {c.operand}": time_cast(c, device, flushed=False)["chain_us"] for c in chosen}
                step_ms = layers * sum(per_cast.values()) / 1e3
                nbytes = layers * sum(c.nbytes for c in chosen)
                results.append({"kind": kind, "setting": _label(setting), "constants": {k: repr(v) for k, v in setting.items()},
                                "step_ms": step_ms, "tbs": nbytes / (step_ms * 1e-3) / 1e12, "per_cast_us": per_cast, "shipped": setting == shipped})
                print(f"{kind:10s} {_label(setting):45s} {step_ms:.3f} ms a step ({results[-1]['tbs']:.2f} TB/s)"
                      f"{'  (shipped)' if setting == shipped else ''}", flush=True)
        finally:
            for k, v in shipped.items():
                setattr(fp8, k, v)
    return results


def table(rows: list[dict], layers: int, ceiling_tbs: float) -> str:
    lines = ["| linear | operand | cast | shape | MB | chained us (TB/s) | flushed us (TB/s) | host us |", "|---|---|---|---|---:|---:|---:|---:|"]
    for r in rows:
        lines.append(f"| {r['linear']} | {r['operand']} | {r['kind']} | {r['shape'][0]}x{r['shape'][1]} | {r['bytes'] / 1e6:.1f} | "
                     f"{r['chain_us']:.1f} ({r['chain_tbs']:.2f}) | {r['graph_us']:.1f} ({r['graph_tbs']:.2f}) | {r['host_us']:.1f} |")
    nbytes = layers * sum(r["bytes"] for r in rows)
    chained = layers * sum(r["chain_us"] for r in rows) / 1e3
    flushed = layers * sum(r["graph_us"] for r in rows) / 1e3
    host = layers * sum(r["host_us"] for r in rows) / 1e3
    floor = nbytes / (ceiling_tbs * 1e12) * 1e3
    lines += ["", f"a step ({layers} blocks, {len(rows) * layers} casts, {nbytes / 1e9:.2f} GB): chained {chained:.2f} ms "
              f"({nbytes / (chained * 1e-3) / 1e12:.2f} TB/s), flushed {flushed:.2f} ms, host {host:.2f} ms; "
              f"at the copy ceiling ({ceiling_tbs:.2f} TB/s) {floor:.2f} ms"]
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=8192, help="tokens a GPU a step (the seed's 8 x 1024)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=8192, help="the MLP's hidden width")
    p.add_argument("--layers", type=int, default=12, help="blocks a step")
    p.add_argument("--recipe", default="rowwise_with_gw_tensorwise", choices=sorted(fp8_recipes()))
    p.add_argument("--sweep", action="store_true", help="also time the step's casts under each launch setting")
    p.add_argument("--out", default=None, help="directory for casts.json (and sweep.json)")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_casts times the float8 casts on an NVIDIA GPU; none is visible here")
    device = torch.device("cuda")
    casts = step_casts(args.tokens, args.dim, args.hidden, args.recipe)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, {args.recipe}, tokens {args.tokens}", flush=True)
    ceiling = copy_ceiling_tbs(device, 2**30)
    rows = measure(casts, device)
    print(table(rows, args.layers, ceiling))
    results = sweep(casts, device, args.layers) if args.sweep else []
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "casts.json").write_text(json.dumps({"ceiling_tbs": ceiling, "rows": rows}, indent=1))
        if results:
            Path(args.out, "sweep.json").write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
