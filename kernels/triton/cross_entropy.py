"""Fused cross-entropy: the loss and its gradient in one kernel, two passes over each row's logits.

Eager cross-entropy reads the (tokens x vocab) logits for log_softmax, writes log-probabilities,
reads them for nll, and in backward reads and writes a tensor of that size twice more. Here each
row is read once for an online max / sum-of-exponentials (the running-max rescaling of
FlashAttention's softmax) and once more to write the gradient, softmax - target distribution,
scaled for the mean, straight into the logits buffer, which no other op needs once the loss is
taken (the head's backward needs its input and weight, not its output). Backward only scales
that buffer by the incoming gradient. Mean over the rows whose target is not `ignore_index`; the
count stays on the device, so there is no host sync.

Label smoothing as torch defines it: the target distribution is (1 - e) on the target plus e / V
everywhere, so loss = logsumexp(x) - (1 - e) x_t - (e / V) sum(x) and grad = p - (1 - e) onehot - e / V;
the first pass also sums the row for it.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _cross_entropy_fwd_bwd(LOGITS, stride, TARGETS, LOSS, N_VALID, V, ignore_index, smoothing, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    target = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        for off in range(0, V, BLOCK):
            tl.store(ptr + off + cols, tl.zeros((BLOCK,), dtype=tl.float32).to(LOGITS.dtype.element_ty), mask=off + cols < V)
        tl.store(LOSS + row, 0.0)
    else:
        inv_n = 1.0 / tl.load(N_VALID).to(tl.float32)
        m = -float("inf")
        d = 0.0
        row_sum = 0.0
        for off in range(0, V, BLOCK):  # pass 1: running max, sum of exp(x - max), sum of x
            mask = off + cols < V
            x = tl.load(ptr + off + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
            row_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
            m = m_new
        x_target = tl.load(ptr + target).to(tl.float32)
        lse = tl.log(d) + m
        loss = lse - (1.0 - smoothing) * x_target - smoothing * row_sum / V
        tl.store(LOSS + row, loss * inv_n)
        for off in range(0, V, BLOCK):  # pass 2: the gradient of the mean loss, in place
            mask = off + cols < V
            x = tl.load(ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
            grad = tl.exp(x - m) / d - smoothing / V - tl.where(off + cols == target, 1.0 - smoothing, 0.0)
            tl.store(ptr + off + cols, (grad * inv_n).to(LOGITS.dtype.element_ty), mask=mask)


def cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-row losses divided by `n_valid` (a device scalar), with `logits` (rows x V, rows
    contiguous) overwritten by the gradient of their sum. The building block of both the fused
    loss and the chunked linear + cross-entropy, which passes the whole batch's n_valid per chunk."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    # 64K elements per block bound the registers; 4096 keeps a 32000-wide row at 8 blocks a pass.
    block = min(triton.next_power_of_2(vocab), 4096)
    _cross_entropy_fwd_bwd[(rows,)](
        logits, logits.stride(0), targets.contiguous(), losses, n_valid, vocab, ignore_index, float(label_smoothing),
        BLOCK=block, num_warps=8 if block >= 2048 else 4,
    )
    return losses


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float) -> torch.Tensor:
        logits = logits if logits.stride(-1) == 1 else logits.contiguous()
        n_valid = (targets != ignore_index).sum().clamp_min(1)
        losses = cross_entropy_grad_(logits, targets, n_valid, ignore_index, label_smoothing)
        ctx.save_for_backward(logits)  # now holds d(mean loss)/d(logits)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        return grad * grad_output.to(grad.dtype), None, None, None


class FusedCrossEntropyLoss(torch.nn.Module):
    """Drop-in for nn.CrossEntropyLoss (mean reduction) on (N, V) logits it may overwrite."""

    def __init__(self, ignore_index: int = -100, label_smoothing: float = 0.0):
        super().__init__()
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    def forward(self, logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return fused_cross_entropy(logits, targets, self.ignore_index, self.label_smoothing)


def fused_cross_entropy(logits: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Mean cross-entropy of (N, V) logits against (N,) targets, as F.cross_entropy. The logits
    buffer is overwritten with the gradient: pass logits that nothing else reads afterwards."""
    return CrossEntropyFunction.apply(logits, targets, ignore_index, label_smoothing)
