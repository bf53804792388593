"""Linear products of a few rows (decode at batch 2-8) as matrix-vector kernels (`edge.matvec_rows`).

IREE 3.13's SPIR-V backend gives a product of one row (decode at batch 1) its SubgroupReduce
pipeline: one workgroup per output, 512-32,000 workgroups for `model=small`'s projections and head.
At 2 rows and more, `x @ W^T` goes to the general matmul pipeline (MatmulPromoteVectorize) with
N tiled 128-512 wide: on `pascal`, `model=small`'s projections at batch 4 ran on a handful of
workgroups of a GPU with many SMs, several times slower than torch's decode step, and written
weights first level with it (benchmarks/edge_vs_torch.py compares them). The same product written
weights first, `(W @ x^T)^T`, is a matmul of N rows by `rows` columns, which IREE's configuration
takes for a matrix-vector product again (its reduction is the innermost dim of both operands): one
workgroup per (output, row), SubgroupReduce, the transpose back fused into the same dispatch
(`iree-compile --iree-hal-dump-executable-configurations-to`, `pascal`, fp16):

| product (rows x in -> out) | x @ W^T | (W @ x^T)^T |
|---|---|---|
| 4 x 512 -> 2048 | MatmulPromoteVectorize, tile 4 x 512: 4 workgroups | SubgroupReduce: 8192 |
| 4 x 2048 -> 8192 (mini_llm's MLP) | tile 4 x 512: 16 | SubgroupReduce: 32768 |
| 4 x 512 -> 32000 (small's head) | tile 4 x 256: 125 | SubgroupReduce: 128000 |
| 8 x 512 -> 2048 | tile 8 x 256: 8 | SubgroupReduce: 16384 |
| 16 x 512 -> 2048 | general matmul | MatmulPromoteVectorize, tiles 256 x 16: 8 |

So up to 8 rows; past that IREE tiles it as a matmul either way. Each workgroup reads one weight
row per sequence: `rows` times the bytes of the batch-1 kernels, from L2 after the first. The
torch baselines never take this form (cuBLAS has its own small-M kernels); only the exported
module does.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

# the most rows IREE 3.13 still compiles (W @ x^T) for as a SubgroupReduce matvec (table above)
MAX_MATVEC_ROWS = 8


def matvec_rows_error(rows: int) -> str | None:
    """Why edge.matvec_rows=`rows` cannot be, or None."""
    if 0 <= rows <= MAX_MATVEC_ROWS:
        return None
    return f"edge.matvec_rows={rows}: IREE compiles products of at most {MAX_MATVEC_ROWS} rows as matvecs; use 0 (off) to {MAX_MATVEC_ROWS}"


def weights_first(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear(x, weight, bias) computed as (weight @ x^T)^T over x's rows."""
    rows = x.reshape(-1, x.shape[-1])
    y = (weight @ rows.t()).t().reshape(*x.shape[:-1], weight.shape[0])
    return y if bias is None else y + bias


def few_rows(x: torch.Tensor, matvec_rows: int) -> bool:
    """Whether a product of `x` (rows of x.shape[-1]) takes the weights-first form: 2 to `matvec_rows`
    rows (one row is a matvec already)."""
    return takes_weights_first(x.numel() // x.shape[-1], matvec_rows)


def takes_weights_first(rows: int, matvec_rows: int) -> bool:
    """few_rows by the count of rows."""
    return 1 < rows <= matvec_rows


class MatvecLinear(nn.Linear):
    """nn.Linear whose products of 2 to `matvec_rows` rows are computed weights first. Made from an
    nn.Linear by `use_matvec` (its class swapped in place): the same parameters, names and ties."""

    matvec_rows: int = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if few_rows(x, self.matvec_rows):
            return weights_first(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)


def use_matvec(lm: nn.Module, matvec_rows: int) -> nn.Module:
    """Every Linear of `lm` (an EdgeLM: the blocks' and the head; QuantLinear's too) computes products
    of 2 to `matvec_rows` rows weights first; 0 or 1 leaves `lm` as it is. In place; returns `lm`."""
    why = matvec_rows_error(matvec_rows)
    if why:
        raise ValueError(why)
    if matvec_rows <= 1:
        return lm
    from src.edge.quant import QuantLinear

    for module in lm.modules():
        if type(module) is nn.Linear:
            module.__class__ = MatvecLinear
        if isinstance(module, (MatvecLinear, QuantLinear)):
            module.matvec_rows = matvec_rows
    return lm


def matvec_rows(lm: nn.Module) -> int:
    """The `matvec_rows` `lm`'s Linears were given (0: none), for the module's cache key and manifest."""
    from src.edge.quant import QuantLinear

    return max((getattr(m, "matvec_rows", 0) for m in lm.modules() if isinstance(m, (MatvecLinear, QuantLinear))), default=0)
