"""Fused linear + cross-entropy: the output head and the loss without the (tokens x vocab) logits.

For the seed's step (8 x 2048 tokens, 32000-token head) the logits alone are 16384 x 32000: 1.05 GB
in bf16, 2.1 GB once upcast for the loss, plus their gradient. Here the tokens are walked in
chunks; per chunk the logits are computed (one GEMM), turned into their gradient in place by the
fused cross-entropy kernel (kernels/triton/cross_entropy.py), and consumed at once by the two
GEMMs of the head's backward: grad_hidden = dlogits @ W and grad_W += dlogits^T @ hidden. So the
whole backward happens inside forward, and only one chunk of logits ever exists; backward only
scales the two saved gradients by the incoming one.

A chunk's logits take at most LOGITS_CHUNK_BYTES (128 MB: 2048 tokens x 32000 in bf16), and a
chunk is never under MIN_CHUNK_ROWS tokens. Liger-Kernel's rule (a chunk's logits about the size of
the hidden input, 512 tokens at the seed's shapes) makes 16 chunks whose grad_W updates each read
and write the whole 32000 x 2048 weight gradient with K = 512, about 4 GB of traffic a step; 4
chunks of 2048 keep the GEMMs large and the peak (logits chunk, grad_hidden, grad_W, and backward's
outputs) near 500 MB, under the 700 MB that the unfused head and loss's logits alone exceed. The
floor is grad_W's: its addmm does 2 x rows x V x D FLOPs on 2 x V x D x element-size bytes of
gradient read and written, rows / element-size FLOPs a byte: at 2048 rows 1024 in bf16, about 5x
a current GPU's ridge point (its bf16 FLOP/s over its memory bandwidth; fp32 against TF32's
half-rate likewise), so the gradient's traffic stays a fifth of the GEMM's time or less. At LLaMA 3's 128256-token
vocabulary the byte budget alone gave 512 rows: 16 chunks at 4 x 2048 tokens, 16.8 GB of grad_W
traffic a step (benchmarks/lce_chunks.py measures the chunk sizes side by side).
grad_W accumulates in the GEMMs' dtype through addmm_ (cuBLAS adds into it in fp32 and rounds
once per chunk), as Liger-Kernel does: an fp32 accumulator fed by `(dlogits^T @ h).float()` costs
three extra passes over the V x D weight per chunk, more than the fp32 rounding saves is worth.

`float8=True` runs the logits GEMM in float8 e4m3 with rowwise scales, as the blocks' float8 linears run
their output GEMMs (kernels/triton/fp8_linear.py: a scale a token of the hidden input, a scale a vocabulary
row of W, fast accumulation): W and the hidden input are cast once a forward (0.28 GB of e4m3 at LLaMA 3.2
1B's shape), each chunk's logits come from `torch._scaled_mm`. The cross-entropy and the two backward GEMMs
are as before, in the input's dtype: the logits' gradient (the softmax of the float8 logits) times the
unquantized W and hidden input, the straight-through gradient of the float8 GEMM. That gradient is left out of
e4m3: scaled to its row's largest value, e4m3 reaches down 2**17.8 (448 to the subnormal 2**-9), and at a
128256-token vocabulary a uniform softmax's entries are already 2**-17 of the target's -1, a trained one's tail lower. At
LLaMA 3.2 1B's shape the logits GEMM is the largest bf16 GEMM left in a float8 step, which is why it
moves to float8 (docs/RESULTS.md, precision.fp8_head, has the step's times).
"""
from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from perflab_kernels.triton.cross_entropy import count_valid, cross_entropy_grad_, scale_unless_one_

LOGITS_CHUNK_BYTES = 128 * 2**20
MIN_CHUNK_ROWS = 2048
FLOAT8_ALIGN = 16  # torch._scaled_mm: the inner dimension and the output's columns multiples of 16


def chunk_rows(tokens: int, vocab: int, element_size: int) -> int:
    """The most rows (a power of two) whose logits fit LOGITS_CHUNK_BYTES, but no fewer than
    MIN_CHUNK_ROWS, and at most all of them."""
    fit = max(1, LOGITS_CHUNK_BYTES // (vocab * element_size))
    return max(1, min(tokens, max(MIN_CHUNK_ROWS, 2 ** int(math.log2(fit)))))


class LinearCrossEntropyFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int, label_smoothing: float, chunk: int,
                float8: bool = False) -> torch.Tensor:
        hidden = hidden.contiguous()
        tokens, dim = hidden.shape
        vocab = weight.shape[0]
        # Under autocast the GEMMs run in its dtype; the cross-entropy kernel works in fp32 anyway.
        dtype = torch.get_autocast_dtype(hidden.device.type) if torch.is_autocast_enabled(hidden.device.type) else hidden.dtype
        h, w = hidden.to(dtype), weight.to(dtype)
        targets = targets if targets.is_contiguous() else targets.contiguous()
        n_valid = count_valid(targets, ignore_index)
        chunk = chunk or chunk_rows(tokens, vocab, h.element_size())
        grad_hidden = torch.empty_like(h)
        # the first chunk's GEMM writes grad_W, later ones add to it: no zero-fill pass
        grad_weight = torch.empty(vocab, dim, dtype=dtype, device=h.device) if weight.requires_grad else None
        loss = torch.zeros((), dtype=torch.float32, device=h.device)
        if float8:
            h8, h_inv, w8, w_inv = _float8_operands(h, w)
        with torch.autocast(h.device.type, enabled=False):
            for start in range(0, tokens, chunk):
                h_c = h[start : start + chunk]
                if float8:
                    logits = torch._scaled_mm(h8[start : start + chunk], w8.t(), scale_a=h_inv[start : start + chunk], scale_b=w_inv, out_dtype=dtype,
                                              use_fast_accum=True)
                else:
                    logits = h_c @ w.t()  # (chunk, V): the only logits there ever are
                loss += cross_entropy_grad_(logits, targets[start : start + chunk], n_valid, ignore_index, label_smoothing).sum()
                torch.mm(logits, w, out=grad_hidden[start : start + chunk])
                if grad_weight is not None:
                    if start == 0:
                        torch.mm(logits.t(), h_c, out=grad_weight)
                    else:
                        grad_weight.addmm_(logits.t(), h_c)
        ctx.save_for_backward(grad_hidden, grad_weight if grad_weight is not None else torch.empty(0))
        ctx.dtypes = (hidden.dtype, weight.dtype)
        return loss

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor):
        grad_hidden, grad_weight = ctx.saved_tensors
        hidden_dtype, weight_dtype = ctx.dtypes
        scale = grad_output.reshape(())
        # in place, skipped on the device when the incoming gradient is 1 (loss.backward())
        dh = scale_unless_one_(grad_hidden, scale).to(hidden_dtype)
        dw = scale_unless_one_(grad_weight, scale).to(weight_dtype) if ctx.needs_input_grad[1] and grad_weight.numel() else None
        return dh, dw, None, None, None, None, None


def _float8_operands(h: torch.Tensor, w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(h8, h_inv, w8, w_inv): the hidden input and W in e4m3, a scale a row each (fp8_linear's rowwise
    cast), w_inv viewed (1, V) as _scaled_mm's scale_b."""
    from perflab_kernels.triton.fp8_linear import rowwise_e4m3

    dim, vocab = h.shape[1], w.shape[0]
    if dim % FLOAT8_ALIGN or vocab % FLOAT8_ALIGN:
        raise ValueError(f"a float8 head needs its width and vocabulary multiples of {FLOAT8_ALIGN} (torch._scaled_mm's terms), got dim {dim}, vocab {vocab}")
    h8, h_inv = rowwise_e4m3(h)
    w8, w_inv = rowwise_e4m3(w)
    return h8, h_inv, w8, w_inv.view(1, -1)


def fused_linear_cross_entropy(hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, ignore_index: int = -100, label_smoothing: float = 0.0,
                               chunk: int = 0, float8: bool = False) -> torch.Tensor:
    """F.cross_entropy(hidden @ weight.T, targets) for (N, D) hidden, (V, D) weight, (N,) targets,
    never holding more than `chunk` rows of logits (0: the size rule above); `float8`, the logits GEMM in
    float8 (above)."""
    return LinearCrossEntropyFunction.apply(hidden, weight, targets, ignore_index, label_smoothing, chunk, float8)


class LinearCrossEntropyHead(nn.Module):
    """Drop-in for the model's bias-free nn.Linear head: forward still gives logits (inference,
    evaluation); `loss(hidden, targets)` gives the training loss without them. `float8` (set by
    precision.fp8_head): the loss's logits GEMM in float8; forward's logits stay the bf16 GEMM's."""

    float8 = False

    def __init__(self, weight: nn.Parameter, ignore_index: int = -100, label_smoothing: float = 0.0):
        super().__init__()
        self.weight = weight  # the same Parameter: swapping keeps state dicts and sharding intact
        self.ignore_index, self.label_smoothing = ignore_index, label_smoothing

    @classmethod
    def from_module(cls, head: nn.Linear) -> LinearCrossEntropyHead:
        if head.bias is not None:
            raise ValueError("the fused linear + cross-entropy head takes a bias-free nn.Linear")
        return cls(head.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)

    def loss(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return fused_linear_cross_entropy(hidden.reshape(-1, hidden.shape[-1]), self.weight, targets.reshape(-1), self.ignore_index, self.label_smoothing,
                                          float8=self.float8)

    def extra_repr(self) -> str:
        return "float8 logits GEMM" if self.float8 else ""
