"""Fused cross-entropy: the loss and its gradient in one kernel, two passes over each row's logits.

Eager cross-entropy reads the (tokens x vocab) logits for log_softmax, writes log-probabilities,
reads them for nll, and in backward reads and writes a tensor of that size twice more. Here each
row is read once for an online max / sum-of-exponentials (the running-max rescaling of
FlashAttention's softmax) and once more to write the gradient, softmax - target distribution,
scaled for the mean, straight into the logits buffer, which no other op needs once the loss is
taken (the head's backward needs its input and weight, not its output). Backward only scales
that buffer by the incoming gradient, and not even that when it is 1, the loss.backward() case
(checked on the device: no host sync). Mean over the rows whose target is not `ignore_index`; the
count stays on the device, so there is no host sync.

Label smoothing as torch defines it: the target distribution is (1 - e) on the target plus e / V
everywhere, so loss = logsumexp(x) - (1 - e) x_t - (e / V) sum(x) and grad = p - (1 - e) onehot - e / V;
the first pass also sums the row for it.
"""
from __future__ import annotations

import torch

import triton
import triton.language as tl
from perflab_kernels.triton import pdl
from perflab_kernels.triton.device import device_index, sm_count
from perflab_kernels.triton.launch import Launcher
from perflab_kernels.triton.pdl import gdc_prologue  # by name in the kernels: kernels/triton/pdl.py says why

# Launch settings at the seed's shape (benchmarks/kernel_configs.py sweeps them): the row in blocks
# of BLOCK, two passes, the second served from L2 (the rows all SMs hold at once fit in L2 many times
# over); or the whole row in registers, one read (ROW_IN_REGISTERS). The widest block at 16 warps
# beat half of it at 8 warps once the second pass multiplies instead of dividing (fewer
# instructions per element left the wider block ahead).
BLOCK_MAX = 8192
NUM_WARPS = 16
ROW_IN_REGISTERS_MAX = 0  # widest vocabulary read once into registers (0: never)
ROW_IN_REGISTERS_WARPS = 16


@triton.jit
def _count_valid(TARGETS, N_VALID, rows, ignore_index, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """n_valid = max(1, #targets != ignore_index), as fp32 on the device: the mean's divisor with no
    host sync, in one launch where (targets != i).sum().clamp_min(1) takes three."""
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    count = tl.zeros((BLOCK,), dtype=tl.int32)
    for off in range(0, rows, BLOCK):
        idx = off + tl.arange(0, BLOCK)
        t = tl.load(TARGETS + idx, mask=idx < rows, other=ignore_index)
        count += (t != ignore_index).to(tl.int32)
    tl.store(N_VALID, tl.maximum(tl.sum(count, axis=0), 1).to(tl.float32))


@triton.jit
def _cross_entropy_fwd_bwd(LOGITS, stride, TARGETS, LOSS, N_VALID, V, ignore_index, smoothing, BLOCK: tl.constexpr, ROW_IN_REGISTERS: tl.constexpr,
                           HAS_SMOOTHING: tl.constexpr, USE_GDC: tl.constexpr):
    """One row a program. At the seed's shape the two passes are bound by their exponentials, close
    to what the SMs' special-function units issue: the gradient multiplies by 1 / sum and 1 / n_valid, once per row, instead of dividing
    per element, and without label smoothing the row's plain sum is not taken (HAS_SMOOTHING)."""
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride
    target = tl.load(TARGETS + row)
    cols = tl.arange(0, BLOCK)
    if target == ignore_index:
        for off in range(0, V, BLOCK):
            tl.store(ptr + off + cols, tl.zeros((BLOCK,), dtype=tl.float32).to(LOGITS.dtype.element_ty), mask=off + cols < V)
        tl.store(LOSS + row, 0.0)
    else:
        inv_n = 1.0 / tl.load(N_VALID)
        if ROW_IN_REGISTERS:  # BLOCK >= V: one read, one exp per element, one write
            mask = cols < V
            x = tl.load(ptr + cols, mask=mask, other=-float("inf")).to(tl.float32)
            m = tl.max(x, axis=0)
            e = tl.exp(x - m)
            d = tl.sum(e, axis=0)
            row_sum = tl.sum(tl.where(mask, x, 0.0), axis=0) if HAS_SMOOTHING else 0.0
            x_target = tl.sum(tl.where(cols == target, x, 0.0), axis=0)
            p_scale = inv_n / d
            grad = e * p_scale - smoothing * inv_n / V - tl.where(cols == target, (1.0 - smoothing) * inv_n, 0.0)
            tl.store(ptr + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)
        else:
            m = -float("inf")
            d = 0.0
            row_sum = 0.0
            for off in range(0, V, BLOCK):  # pass 1: running max, sum of exp(x - max), sum of x
                mask = off + cols < V
                x = tl.load(ptr + off + cols, mask=mask, other=-float("inf")).to(tl.float32)
                m_new = tl.maximum(m, tl.max(x, axis=0))
                d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
                if HAS_SMOOTHING:
                    row_sum += tl.sum(tl.where(mask, x, 0.0), axis=0)
                m = m_new
            x_target = tl.load(ptr + target).to(tl.float32)
            p_scale = inv_n / d  # softmax / n_valid = exp(x - m) * (1 / (d * n_valid)): no division per element
            uniform = smoothing * inv_n / V
            on_target = (1.0 - smoothing) * inv_n
            for off in range(0, V, BLOCK):  # pass 2: the gradient of the mean loss, in place
                mask = off + cols < V
                x = tl.load(ptr + off + cols, mask=mask, other=0.0).to(tl.float32)
                grad = tl.exp(x - m) * p_scale - uniform - tl.where(off + cols == target, on_target, 0.0)
                tl.store(ptr + off + cols, grad.to(LOGITS.dtype.element_ty), mask=mask)
        lse = tl.log(d) + m
        loss = lse - (1.0 - smoothing) * x_target - smoothing * row_sum / V
        tl.store(LOSS + row, loss * inv_n)


@triton.jit
def _scale_unless_one(X, SCALE, n, BLOCK: tl.constexpr, USE_GDC: tl.constexpr):
    """x *= scale in place, unless scale == 1 (the loss's own gradient in loss.backward()): then
    every program returns after one scalar load, so the common case costs a launch, not a pass
    over the (tokens x vocab) gradient, and needs no host sync to tell which case it is."""
    gdc_prologue(USE_GDC)  # kernels/triton/pdl.py: waits for the previous kernel's writes
    scale = tl.load(SCALE).to(tl.float32)
    if scale != 1.0:
        step = tl.num_programs(0).to(tl.int64) * BLOCK
        for off in range(tl.program_id(0).to(tl.int64) * BLOCK, n, step):
            idx = off + tl.arange(0, BLOCK)
            mask = idx < n
            x = tl.load(X + idx, mask=mask).to(tl.float32)
            tl.store(X + idx, (x * scale).to(X.dtype.element_ty), mask=mask)


# kernels/triton/launch.py: cached launches (host cost per launch)
_launch_count, _launch_fwd_bwd, _launch_scale = Launcher(_count_valid), Launcher(_cross_entropy_fwd_bwd), Launcher(_scale_unless_one)


def _programs(t: torch.Tensor) -> int:
    # a grid-stride loop over 4 programs per SM: enough loads in flight to stream at the copy
    # ceiling, and an early exit that costs a few microseconds when there is nothing to do
    return sm_count(device_index(t)) * 4


def launch_settings(vocab: int) -> tuple[int, int, bool]:
    """(BLOCK, num_warps, row in registers) for rows of `vocab` logits."""
    if vocab <= ROW_IN_REGISTERS_MAX:
        return triton.next_power_of_2(vocab), ROW_IN_REGISTERS_WARPS, True
    # 64K elements per block bound the registers; 8192 keeps a 32000-wide row at 4 blocks a pass.
    block = min(triton.next_power_of_2(vocab), BLOCK_MAX)
    return block, NUM_WARPS if block >= BLOCK_MAX else (8 if block >= 2048 else 4), False


def count_valid(targets: torch.Tensor, ignore_index: int) -> torch.Tensor:
    """max(1, number of targets that are not ignore_index), an fp32 device scalar."""
    n_valid = torch.empty((), dtype=torch.float32, device=targets.device)
    gdc = pdl.use_gdc(targets)
    _launch_count((1,), targets, n_valid, targets.numel(), ignore_index, BLOCK=1024, USE_GDC=gdc, num_warps=4, **pdl.launch_options(gdc))
    return n_valid


def cross_entropy_grad_(logits: torch.Tensor, targets: torch.Tensor, n_valid: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0) -> torch.Tensor:
    """Per-row losses divided by `n_valid` (an fp32 device scalar), with `logits` (rows x V, rows
    contiguous) overwritten by the gradient of their sum. The building block of both the fused
    loss and the chunked linear + cross-entropy, which passes the whole batch's n_valid per chunk."""
    rows, vocab = logits.shape
    losses = torch.empty(rows, dtype=torch.float32, device=logits.device)
    block, warps, in_registers = launch_settings(vocab)
    gdc = pdl.use_gdc(logits)
    _launch_fwd_bwd(
        (rows,), logits, logits.stride(0), targets, losses, n_valid, vocab, ignore_index, float(label_smoothing),
        BLOCK=block, ROW_IN_REGISTERS=in_registers, HAS_SMOOTHING=label_smoothing != 0.0, USE_GDC=gdc, num_warps=warps, **pdl.launch_options(gdc),
    )
    return losses


def scale_unless_one_(t: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """t *= scale in place (t contiguous), skipped on the device when scale == 1."""
    gdc = pdl.use_gdc(t)
    _launch_scale((min(_programs(t), triton.cdiv(t.numel(), 4096)),), t, scale, t.numel(), BLOCK=4096, USE_GDC=gdc, num_warps=8, **pdl.launch_options(gdc))
    return t


class CrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float) -> torch.Tensor:
        logits = logits if logits.is_contiguous() else logits.contiguous()  # backward scales it as one flat buffer
        targets = targets if targets.is_contiguous() else targets.contiguous()
        losses = cross_entropy_grad_(logits, targets, count_valid(targets, ignore_index), ignore_index, label_smoothing)
        ctx.save_for_backward(logits)  # now holds d(mean loss)/d(logits)
        return losses.sum()

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        (grad,) = ctx.saved_tensors
        # in place: the buffer is the logits' own, which nothing else reads after the loss
        return scale_unless_one_(grad, grad_output.reshape(())), None, None, None


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
