"""A tied embedding's gradient added into the head's in place, as torch's CUDA path sums it.

With the head's weight tied to the embedding's (LLaMA 3.2 1B: 128256 x 2048), torch's backward
makes the embedding's gradient as a full-size tensor, zero-filled, with the batch's rows written
into it (`embedding_dense_backward`), and autograd then adds that tensor to the head's gradient
(the two meet in the weight's input buffer): a fill of the whole table, then the whole table read
and written, for only the batch's rows.

Here the embedding's backward gives autograd no gradient for the weight; it leaves (token ids,
output gradient) with the weight, and a post-accumulate-grad hook, which autograd runs once the
head's gradient is the weight's `.grad`, adds the rows the batch touched into it: 2 x 8192 rows
read and written instead of the whole table.

The sums are torch's, bit for bit, on its CUDA path for more than 3072 ids
(aten/src/ATen/native/cuda/EmbeddingBackwardKernel.cu, torch 2.11-2.15): the ids sorted stably;
each id's rows split into partial segments of NROWS_PER_THREAD = 10 rows in that order, each
summed in fp32 from zero; each id's partials summed in fp32 from zero, in order; that sum rounded
to the gradient's dtype; then the head's gradient plus it, computed in fp32 and rounded (torch's
add). Bit for bit where the weight's `.grad` is empty when backward starts (a training step's
zero_grad(set_to_none=True)); onto a gradient already there, torch adds the head's and the
embedding's first and then the sum, where the hook adds the embedding's last: the same values,
rounded once more apart. Two kernels, each program one sorted position: `_partial_sums` where a partial segment
starts, `_segment_fold` where an id's rows start. The positions come from a sort, cumulative max
and min, no host sync. One difference: where the head's gradient holds -0.0 in a row the batch did
not touch, torch's add of the zero-filled row gives +0.0; this leaves -0.0. For 3072 ids or fewer,
torch sums in another order (a kernel per feature), and fp64 it sums in fp64: there the backward
returns torch's own gradient, so that path is torch's. It does the same where torch's sort path adds
each partial into the gradient with atomics (`torch_sums_atomically`: few rows in the table and narrow
ones, as a 64-token vocabulary): an order that changes from run to run, so no fold could match it, and
a table so small that its full-size gradient costs nothing.
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

import triton
import triton.language as tl
from perflab_kernels.triton.device import device_index, kernels_run_on, sm_count
from perflab_kernels.triton.rounding import bf16_rne  # by name in the kernels: kernels/triton/pdl.py says why

NROWS = 10  # torch's NROWS_PER_THREAD: rows in a partial segment
TORCH_SORT_PATH_ABOVE = 3072  # torch's CUDA embedding backward sorts the ids above this many (below: another order)
DTYPES = (torch.bfloat16, torch.float16, torch.float32)  # torch sums these in fp32, as the kernels do
# torch's heuristic for its fused atomic kernel (EmbeddingBackwardKernel.cu): its threads per block at
# most, the blocks an SM takes below which a kernel per id is "poor parallelism", and a warp's threads
MAX_BLOCK_SIZE, MAX_ATOMIC_ACCUM_BLOCKS_PER_SM, WARP = 1024, 4, 32
# 1024 columns and 4 warps a program: LLaMA's 2048-wide rows in two programs, each row read as 8 B a thread
BLOCK_D, NUM_WARPS = 1024, 4


@triton.jit
def _partial_sums(GY, ORDER, PLEN, PART, D, BLOCK_D: tl.constexpr):
    """Program (i, c): where a partial segment starts at sorted position i (PLEN[i] > 0 rows), the
    fp32 sum from zero of its rows of GY (GY[ORDER[i]], GY[ORDER[i + 1]], ...), columns c * BLOCK_D on."""
    i = tl.program_id(0)
    n = tl.load(PLEN + i)
    if n > 0:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for j in range(0, n):
            row = tl.load(ORDER + i + j).to(tl.int64)
            acc += tl.load(GY + row * D + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(PART + i.to(tl.int64) * D + cols, acc, mask=mask)


@triton.jit
def _segment_fold(PART, SLEN, IDS, GRAD, D, stride_g, NROWS: tl.constexpr, BLOCK_D: tl.constexpr, BF16: tl.constexpr):
    """Program (i, c): where an id's rows start at sorted position i (SLEN[i] > 0 rows), its partial
    sums (at i, i + NROWS, ...) summed in fp32 from zero, in order, rounded to GRAD's dtype, and
    added to GRAD's row for the id (in fp32, rounded): torch's sum_and_scatter, then its add. BF16:
    GRAD is bf16, rounded to nearest even by bf16_rne (the interpreter's conversion truncates)."""
    i = tl.program_id(0)
    n = tl.load(SLEN + i)
    if n > 0:
        cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask = cols < D
        acc = tl.zeros((BLOCK_D,), dtype=tl.float32)
        for k in range(0, n, NROWS):
            acc += tl.load(PART + (i + k).to(tl.int64) * D + cols, mask=mask, other=0.0)
        row = tl.load(IDS + i).to(tl.int64)
        g = tl.load(GRAD + row * stride_g + cols, mask=mask, other=0.0)
        if BF16:
            y = bf16_rne(g.to(tl.float32) + bf16_rne(acc).to(tl.float32))
        else:
            y = (g.to(tl.float32) + acc.to(GRAD.dtype.element_ty).to(tl.float32)).to(GRAD.dtype.element_ty)
        tl.store(GRAD + row * stride_g + cols, y, mask=mask)


def segments(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(sorted ids, order, partial lengths, id lengths) of flat `ids`, each of len(ids), by sorted
    position: order[i] the original position of the i-th sorted id (stable: equal ids in their
    original order, as torch's radix sort leaves them); plen[i] the rows of the partial segment that
    starts at i, 0 where none does; slen[i] the rows of the id whose rows start at i, 0 where none does."""
    n = ids.numel()
    sorted_ids, order = torch.sort(ids, stable=True)
    pos = torch.arange(n, device=ids.device)
    head = torch.ones(n, dtype=torch.bool, device=ids.device)
    head[1:] = sorted_ids[1:] != sorted_ids[:-1]
    start = torch.cummax(torch.where(head, pos, 0), 0).values  # where each position's id starts
    # where it ends: the first start after it (n past the last), a cumulative min from the right
    starts_after = torch.where(head, pos, n).flip(0).cummin(0).values.flip(0)
    end = torch.cat([starts_after[1:], starts_after.new_full((1,), n)])
    plen = torch.where((pos - start) % NROWS == 0, torch.clamp(end - pos, max=NROWS), 0)
    slen = torch.where(head, end - pos, 0)
    return sorted_ids, order, plen, slen


def torch_sums_atomically(numel: int, num_weights: int, dim: int, sms: int) -> bool:
    """Whether torch's CUDA sort path, for `numel` ids into a (num_weights, dim) table on a GPU of
    `sms` SMs, takes its fused kernel, which adds each partial sum into the gradient with atomics
    instead of summing an id's partials in order: where a kernel per id would fill fewer than 4
    blocks an SM and the partials outnumber its blocks 4 to 1, unless deterministic algorithms are
    asked for. Measured on CUDA with torch 2.11: two runs of the same backward on a small table gave
    gradients that differed in many of their values."""
    if torch.are_deterministic_algorithms_enabled():
        return False
    max_segments = min(numel, num_weights)
    stride_warped = triton.cdiv(dim, WARP) * WARP
    grid = triton.cdiv(max_segments * stride_warped, min(stride_warped, MAX_BLOCK_SIZE))
    return grid < sms * MAX_ATOMIC_ACCUM_BLOCKS_PER_SM and numel // NROWS + max_segments > grid * 4


def _sums_atomically(ids: torch.Tensor, num_weights: int, gy: torch.Tensor) -> bool:
    """torch_sums_atomically for this backward; never on a CPU (Triton's interpreter), which has no SMs
    and whose tests check the fold against torch's sort path written out."""
    index = device_index(gy)
    return index >= 0 and torch_sums_atomically(ids.numel(), num_weights, gy.shape[-1], sm_count(index))


def fold_rows_(grad: torch.Tensor, ids: torch.Tensor, grad_output: torch.Tensor) -> torch.Tensor:
    """grad (V, D) += the embedding gradient of `ids` (any shape) given `grad_output` (ids' shape + (D,)),
    in place, summed as torch's CUDA sort path sums it (the module docstring). Returns grad."""
    d = grad.shape[1]
    flat = ids.reshape(-1)
    if flat.numel() == 0:
        return grad
    if grad.stride(1) != 1:
        raise ValueError("fold_rows_ writes rows of a gradient whose columns are contiguous")
    gy = grad_output.reshape(-1, d).contiguous()
    sorted_ids, order, plen, slen = segments(flat)
    part = torch.empty((flat.numel(), d), dtype=torch.float32, device=grad.device)
    grid = (flat.numel(), triton.cdiv(d, BLOCK_D))
    _partial_sums[grid](gy, order, plen, part, d, BLOCK_D=BLOCK_D, num_warps=NUM_WARPS)
    _segment_fold[grid](part, slen, sorted_ids, grad, d, grad.stride(0), NROWS=NROWS, BLOCK_D=BLOCK_D,
                         BF16=grad.dtype == torch.bfloat16, num_warps=NUM_WARPS)
    return grad


_PENDING = "_tied_embedding_pending"  # on the weight: the (ids, grad_output) pairs its hook folds in
_HOOK = "_tied_embedding_hook"


def _fold_pending(weight: torch.Tensor) -> None:
    """The weight's post-accumulate-grad hook: each pending embedding gradient added into `.grad`."""
    pending = getattr(weight, _PENDING, None)
    while pending:
        ids, gy = pending.pop(0)
        if weight.grad is None:  # nothing else reached the weight: its gradient is the embedding's alone
            weight.grad = torch.zeros_like(weight)
        fold_rows_(weight.grad, ids, gy)


class _FoldedEmbedding(torch.autograd.Function):
    """F.embedding(ids, weight), whose backward leaves its weight gradient for the weight's hook."""

    @staticmethod
    def forward(ctx, ids: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(ids)
        ctx.weight, ctx.num_weights = weight, weight.shape[0]
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, gy: torch.Tensor):
        (ids,) = ctx.saved_tensors
        if ids.numel() <= TORCH_SORT_PATH_ABOVE or gy.dtype not in DTYPES or _sums_atomically(ids, ctx.num_weights, gy):
            # torch sums these otherwise: its own gradient
            return None, torch.ops.aten.embedding_dense_backward(gy, ids, ctx.num_weights, -1, False)
        getattr(ctx.weight, _PENDING).append((ids, gy))
        return None, None


class TiedEmbedding(nn.Embedding):
    """An nn.Embedding whose weight another module's backward also reaches first (a tied head): its
    gradient is added into the weight's `.grad` by the weight's hook rather than handed to autograd
    as a full-size tensor. Made by swapping an nn.Embedding's class (`tie_gradient`), so its
    Parameter, state dict and sharding are the embedding's own. Under torch.compile, without grad,
    or where the kernels cannot run, it is nn.Embedding. For backward() only: torch.autograd.grad
    accumulates nothing, so no hook adds the rows, and the next forward raises."""

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        w = self.weight
        if torch.compiler.is_compiling() or not (torch.is_grad_enabled() and w.requires_grad and kernels_run_on(w)):
            return super().forward(ids)
        if getattr(w, _HOOK, None) is None:  # FSDP2's unsharded parameter, the first time it is seen
            setattr(w, _PENDING, [])
            setattr(w, _HOOK, w.register_post_accumulate_grad_hook(_fold_pending))
        if getattr(w, _PENDING):
            raise RuntimeError("the tied embedding's gradient from the last backward was never added: its weight's gradient was "
                               "not accumulated (is the head in the loss?)")
        return _FoldedEmbedding.apply(ids, w)


def tie_gradient(embed: nn.Embedding) -> bool:
    """Swap `embed` to TiedEmbedding in place; False (nothing changed) where its options make torch
    sum otherwise (padding_idx, max_norm, scale_grad_by_freq, sparse)."""
    if embed.padding_idx is not None or embed.max_norm is not None or embed.scale_grad_by_freq or embed.sparse:
        return False
    embed.__class__ = TiedEmbedding
    return True
