"""The block's GEMMs in bf16 and in float8, each alone: what float8 can save before any cast.

    python -m benchmarks.fp8_gemms [--tokens 8192] [--dim 2048] [--hidden 8192] [--out DIR]

Every nn.Linear of a mini_llm block (qkv 2048 -> 6144, out 2048 -> 2048, MLP up 2048 -> 8192,
down 8192 -> 2048 at the seed's sizes) runs three GEMMs a step: the output Y = X W^T, the grad
input dX = dY W and the grad weight dW = dY^T X. Each is timed as torch.mm in bf16 and as
torch._scaled_mm in float8 e4m3 with the two scalings float8 training uses: one scale a tensor
(tensorwise) and one a row of A and a column of B (rowwise, the scales along the inner
dimension), the latter also with fast accumulation (the output GEMM of torchao's recipes).
_scaled_mm takes A row-major and B column-major, so the operands are laid out as a float8 recipe
would have cast them (W^T, dY^T and X^T copies for the two gradient GEMMs).

Times are GPU times after do_bench's L2 flush (src/fusion/timing.py median_ms); the casts that
produce the float8 operands are not timed here: the table says what they may cost at most for
float8 to pay. Beside each, the host's microseconds to issue one call with the GPU kept busy
(timing.host_us_per_call): a step of mini_llm's 12 blocks issues 96 float8 GEMMs and 48 bf16 ones
under rowwise_with_gw_hp (144 float8 ones under rowwise_with_gw_tensorwise), so tens of
microseconds a call are milliseconds a step of host that must stay under the GPU's. A block's sums
at the end: all in bf16, the output and grad-input GEMMs in float8 with the grad weight kept in
bf16 (the recipe that keeps weight gradients in high precision), and all three in float8.
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from perflab_kernels.triton.fp8_linear import E4M3, E4M3_MAX
from src.fusion.timing import host_us_per_call, median_ms


def block_linears(dim: int, hidden: int) -> list[tuple[str, int, int]]:
    """(name, in features, out features) of a mini_llm block's linears, in forward order."""
    return [("qkv", dim, 3 * dim), ("out", dim, dim), ("up", dim, hidden), ("down", hidden, dim)]


def add_block_shape_args(p: argparse.ArgumentParser) -> None:
    """--tokens, --dim and --hidden: a mini_llm block's sizes, the seed's by default."""
    p.add_argument("--tokens", type=int, default=8192, help="tokens a GPU a step (the seed's 8 x 1024)")
    p.add_argument("--dim", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=8192, help="the MLP's hidden width")


def gemm_shapes(tokens: int, fan_in: int, fan_out: int) -> list[tuple[str, int, int, int]]:
    """(GEMM, M, K, N) of one linear's three GEMMs, C[M, N] = A[M, K] B[K, N]."""
    return [("output", tokens, fan_in, fan_out), ("grad input", tokens, fan_out, fan_in), ("grad weight", fan_out, tokens, fan_in)]


def to_e4m3(t: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(t scaled into e4m3's range and cast, the fp32 scale that undoes it): one scale for the
    tensor when dim is None, else one per slice along `dim` (kept as a size-1 dim)."""
    amax = t.abs().amax() if dim is None else t.abs().amax(dim=dim, keepdim=True)
    scale = E4M3_MAX / amax.float().clamp(min=1e-12)
    return (t.float() * scale).to(E4M3), scale.reciprocal()


def operands(m: int, k: int, n: int, device: torch.device, seed: int = 0) -> dict:
    """A[M, K] and B[K, N] in bf16, and in e4m3 for both scalings: A row-major, B column-major
    (B^T contiguous), as _scaled_mm takes them."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    a = torch.randn(m, k, generator=g).to(device=device, dtype=torch.bfloat16)
    b_t = torch.randn(n, k, generator=g).to(device=device, dtype=torch.bfloat16)  # B^T, rows along K
    a8, sa = to_e4m3(a, None)
    b8, sb = to_e4m3(b_t, None)
    a8r, sar = to_e4m3(a, 1)  # (M, 1): a scale a row of A
    b8r, sbr = to_e4m3(b_t, 1)  # (N, 1): a scale a column of B
    return {"a": a, "b": b_t.t(), "tensorwise": (a8, b8.t(), sa, sb), "rowwise": (a8r, b8r.t(), sar, sbr.t())}


def gemm_fns(ops: dict) -> dict:
    """Provider -> a call of its GEMM, output in bf16."""
    def scaled(key: str, fast: bool):
        a8, b8, sa, sb = ops[key]
        return lambda: torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast)
    return {
        "bf16": lambda: torch.mm(ops["a"], ops["b"]),
        "fp8 tensorwise": scaled("tensorwise", False),
        "fp8 rowwise": scaled("rowwise", False),
        "fp8 rowwise fast": scaled("rowwise", True),
    }


def measure(tokens: int, dim: int, hidden: int, device: torch.device) -> list[dict]:
    rows = []
    for name, fan_in, fan_out in block_linears(dim, hidden):
        for gemm, m, k, n in gemm_shapes(tokens, fan_in, fan_out):
            ops = operands(m, k, n, device)
            flop = 2 * m * k * n
            row = {"linear": name, "gemm": gemm, "M": m, "K": k, "N": n}
            for provider, fn in gemm_fns(ops).items():
                ms = median_ms(fn, device)
                row[provider] = {"ms": ms, "tflops": flop / ms / 1e9, "host_us": host_us_per_call(fn, device)}
            rows.append(row)
            del ops
    return rows


PROVIDERS = ("bf16", "fp8 tensorwise", "fp8 rowwise", "fp8 rowwise fast")


def block_sums(rows: list[dict]) -> dict[str, float]:
    """ms a block: every GEMM bf16; output + grad input in float8 rowwise (output with fast
    accumulation) and grad weight bf16; all three float8 (rowwise; tensorwise)."""
    def t(row, p):
        return row[p]["ms"]
    bf16 = sum(t(r, "bf16") for r in rows)
    hp_wgrad = sum(t(r, "fp8 rowwise fast") if r["gemm"] == "output" else t(r, "fp8 rowwise") if r["gemm"] == "grad input" else t(r, "bf16") for r in rows)
    all_row = sum(t(r, "fp8 rowwise fast") if r["gemm"] == "output" else t(r, "fp8 rowwise") for r in rows)
    all_tensor = sum(t(r, "fp8 tensorwise") for r in rows)
    return {"bf16": bf16, "fp8 rowwise, grad weight bf16": hp_wgrad, "fp8 rowwise": all_row, "fp8 tensorwise": all_tensor}


def table(rows: list[dict]) -> str:
    head = "| linear | GEMM | M x K x N | " + " | ".join(f"{p} ms (TFLOP/s), host us" for p in PROVIDERS) + " | best fp8 / bf16 |"
    lines = [head, "|" + "---|" * (4 + len(PROVIDERS))]
    for r in rows:
        cells = [f"{r[p]['ms']:.4f} ({r[p]['tflops']:.0f}), {r[p]['host_us']:.1f}" for p in PROVIDERS]
        best = min(r[p]["ms"] for p in PROVIDERS[1:])
        lines.append(f"| {r['linear']} | {r['gemm']} | {r['M']}x{r['K']}x{r['N']} | " + " | ".join(cells) + f" | {best / r['bf16']['ms']:.2f} |")
    sums = block_sums(rows)
    lines.append("")
    lines.append("| a block's GEMMs | ms | vs bf16 |")
    lines.append("|---|---:|---:|")
    for k, v in sums.items():
        lines.append(f"| {k} | {v:.3f} | {sums['bf16'] / v:.2f}x |")
    return "\n".join(lines)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_block_shape_args(p)
    p.add_argument("--out", default=None, help="directory for rows.json")
    args = p.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("fp8_gemms times GEMMs on an NVIDIA GPU; none is visible here")
    device = torch.device("cuda")
    rows = measure(args.tokens, args.dim, args.hidden, device)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}, tokens {args.tokens}")
    print(table(rows))
    if args.out:
        Path(args.out).mkdir(parents=True, exist_ok=True)
        Path(args.out, "rows.json").write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
