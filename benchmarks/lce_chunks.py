"""The fused linear + cross-entropy head at several chunk sizes: what the chunk's rows cost.

    python -m benchmarks.lce_chunks [--shape 8192x2048x128256] [--chunks 512,1024,2048,4096,8192] [--json F]

Each chunk of tokens runs three GEMMs of the head (logits, grad_hidden, grad_W) of K = dim, K =
vocab and K = chunk rows, and grad_W's addmm reads and writes the whole (vocab x dim) gradient once
per chunk: at LLaMA 3's vocabulary (128256 x 2048, 525 MB in bf16) 16 chunks of 512 tokens move
16.8 GB for it alone, and grad_hidden's (rows x dim) output is 64 tiles of 128 x 128 on 132 SMs.
Fewer, larger chunks hold more logits at once (rows x vocab x 2 bytes). Every chunk size of
--chunks runs forward + backward side by side in one process, beside the unfused head and loss
(F.linear, then F.cross_entropy in fp32, as the model's unfused path computes it), with `rule` the
chunk kernels/triton/linear_cross_entropy.chunk_rows picks. Reported: GPU median ms (do_bench, L2
flushed), TFLOP/s over the head's 6 x tokens x dim x vocab FLOPs, and the peak memory above the
inputs. Default shapes: LLaMA 3.2 1B's head at 4 x 2048 tokens, LLaMA 3 8B's width, and the seed's
(8 x 2048 tokens, 32000).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F

from perflab_kernels.triton.linear_cross_entropy import chunk_rows, fused_linear_cross_entropy
from src.fusion.timing import median_ms, peak_mb

DEFAULT_SHAPES = ["8192x2048x128256", "8192x4096x128256", "16384x2048x32000"]


def parse_shape(text: str) -> tuple[int, int, int]:
    tokens, dim, vocab = (int(v) for v in text.lower().split("x"))
    return tokens, dim, vocab


def measure(tokens: int, dim: int, vocab: int, chunks: list[int], device: torch.device, dtype: torch.dtype) -> list[dict]:
    torch.manual_seed(0)
    hidden = torch.randn(tokens, dim, device=device, dtype=dtype, requires_grad=True)
    weight = (torch.randn(vocab, dim, device=device) * dim**-0.5).to(dtype).requires_grad_(True)
    targets = torch.randint(0, vocab, (tokens,), device=device)
    flops = 6.0 * tokens * dim * vocab
    rule = chunk_rows(tokens, vocab, hidden.element_size())

    def fused(chunk: int):
        def run():
            fused_linear_cross_entropy(hidden, weight, targets, chunk=chunk).backward()
        return run

    def unfused():
        F.cross_entropy(F.linear(hidden, weight).float(), targets).backward()

    variants = [(f"chunk {c}" + (" (rule)" if c == rule else ""), c, fused(c)) for c in chunks]
    if rule not in chunks:
        variants.append((f"chunk {rule} (rule)", rule, fused(rule)))
    variants.append(("unfused", tokens, unfused))
    rows = []
    for name, chunk, fn in variants:
        try:
            ms = median_ms(fn, device, grad_to_none=[hidden, weight])
            mb = peak_mb(fn, device)
        except torch.OutOfMemoryError:
            rows.append({"shape": f"{tokens}x{dim}x{vocab}", "variant": name, "chunk": chunk, "ms": None, "tflops": None, "peak_mb": None})
            torch.cuda.empty_cache()
            continue
        rows.append({"shape": f"{tokens}x{dim}x{vocab}", "variant": name, "chunk": chunk, "ms": round(ms, 3),
                     "tflops": round(flops / ms / 1e9, 1), "peak_mb": None if mb is None else round(mb)})
        hidden.grad = weight.grad = None
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--shape", action="append", default=[], help="TOKENSxDIMxVOCAB, repeatable (default: " + ", ".join(DEFAULT_SHAPES) + ")")
    ap.add_argument("--chunks", default="512,1024,2048,4096,8192", help="comma-separated chunk rows")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = getattr(torch, args.dtype)
    chunks = [int(c) for c in args.chunks.split(",")]
    rows = []
    print(f"{'shape':<18} {'variant':<20} {'ms':>8} {'TFLOP/s':>8} {'peak MB':>8}")
    for text in args.shape or DEFAULT_SHAPES:
        tokens, dim, vocab = parse_shape(text)
        for r in measure(tokens, dim, vocab, [c for c in chunks if c <= tokens], device, dtype):
            rows.append(r)
            fmt = lambda v: "OOM" if v is None else v  # noqa: E731
            print(f"{r['shape']:<18} {r['variant']:<20} {fmt(r['ms']):>8} {fmt(r['tflops']):>8} {fmt(r['peak_mb']) if device.type == 'cuda' else '-':>8}", flush=True)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                                         "torch": torch.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
