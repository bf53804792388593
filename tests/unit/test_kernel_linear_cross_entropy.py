"""Fused linear + cross-entropy equals the unfused head and loss: loss, grad of hidden and weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from perflab_kernels.triton.linear_cross_entropy import (  # noqa: E402
    LOGITS_CHUNK_BYTES,
    MIN_CHUNK_ROWS,
    LinearCrossEntropyHead,
    chunk_rows,
    fused_linear_cross_entropy,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: GEMMs summed in another order per chunk; bf16: the logits are rounded to bf16 either way,
# grad_W is a sum over all tokens, rounded to bf16 once per chunk here, once in the reference.
TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 3e-2)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,dim,vocab,chunk,smoothing", [(37, 24, 257, 8, 0.0), (5, 16, 123, 0, 0.1), (64, 32, 1000, 64, 0.0)])
def test_matches_linear_then_cross_entropy(tokens, dim, vocab, chunk, smoothing, dtype):
    torch.manual_seed(0)
    atol, rtol = TOLERANCE[dtype]
    hidden = torch.randn(tokens, dim, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, dim, device=DEVICE) * dim**-0.5).to(dtype)
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE)
    targets[::4] = -100

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, w1, targets, label_smoothing=smoothing, chunk=chunk)
    (2 * loss).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    ref = F.cross_entropy((h2 @ w2.t()).float(), targets, label_smoothing=smoothing)
    (2 * ref).backward()

    torch.testing.assert_close(loss, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), atol=atol, rtol=rtol)
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype


def test_a_chunk_of_logits_stays_within_its_byte_budget_above_a_floor_of_rows():
    # 8192 tokens, V 32000 in bf16 -> chunks of 2048 (131 MB of logits; 4 chunks a step)
    assert chunk_rows(8192, 32000, 2) == 2048
    assert chunk_rows(16384, 8000, 2) == 8192  # a small vocabulary: more rows in the same bytes
    assert 2048 * 32000 * 2 <= LOGITS_CHUNK_BYTES < 4096 * 32000 * 2
    # the floor: where the budget would give fewer rows (fp32 logits, LLaMA 3's 128256 tokens),
    # grad_W's addmm still gets K = MIN_CHUNK_ROWS
    assert MIN_CHUNK_ROWS == 2048
    assert chunk_rows(8192, 32000, 4) == 2048
    assert chunk_rows(8192, 128256, 2) == 2048
    assert chunk_rows(3, 32000, 2) == 3  # fewer tokens than either: one chunk
    assert chunk_rows(10, 2**27, 4) == 10


def test_head_keeps_the_linear_weight_and_its_logits():
    linear = torch.nn.Linear(16, 40, bias=False, device=DEVICE)
    head = LinearCrossEntropyHead.from_module(linear)
    assert head.weight is linear.weight
    x = torch.randn(2, 3, 16, device=DEVICE)
    torch.testing.assert_close(head(x), linear(x))
    targets = torch.randint(0, 40, (2, 3), device=DEVICE)
    torch.testing.assert_close(head.loss(x, targets), F.cross_entropy(linear(x).reshape(-1, 40), targets.reshape(-1)), atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="bias-free"):
        LinearCrossEntropyHead.from_module(torch.nn.Linear(4, 5))


# float8 logits: the fused path and the reference GEMM the same e4m3 operands and round the fp32 sums to
# the logits' dtype; they sum in another order (fast accumulation, chunks), so the bf16 logits may land a
# rounding apart. The gradients are the reference's straight-through ones (dlogits of the float8 logits,
# times the unquantized W and hidden input).
FLOAT8_TOLERANCE = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (2e-2, 3e-2)}


def _float8_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden @ weight.T from their rowwise e4m3 casts, in fp32, rounded to hidden's dtype as _scaled_mm's output is."""
    from perflab_kernels.triton.fp8_linear import rowwise_e4m3

    h8, h_inv = rowwise_e4m3(hidden)
    w8, w_inv = rowwise_e4m3(weight)
    return ((h8.float() * h_inv) @ (w8.float() * w_inv).t()).to(hidden.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("tokens,dim,vocab,chunk,smoothing", [(37, 32, 272, 8, 0.0), (5, 16, 128, 0, 0.1), (64, 48, 1008, 64, 0.0)])
def test_float8_logits_give_the_loss_and_straight_through_gradients_of_the_e4m3_gemm(tokens, dim, vocab, chunk, smoothing, dtype):
    if dtype is torch.float32 and DEVICE == "cuda" and torch.cuda.get_device_capability() != (9, 0):
        pytest.skip("torch._scaled_mm writes rowwise-scaled products in fp32 through cuBLAS on compute capability 9.0 only (bf16 or fp16 elsewhere)")
    torch.manual_seed(0)
    atol, rtol = FLOAT8_TOLERANCE[dtype]
    hidden = torch.randn(tokens, dim, device=DEVICE).to(dtype)
    weight = (torch.randn(vocab, dim, device=DEVICE) * dim**-0.5).to(dtype)
    weight[3] *= 1e-3  # a row of another magnitude: its own scale
    targets = torch.randint(0, vocab, (tokens,), device=DEVICE)
    targets[::4] = -100

    h1, w1 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    loss = fused_linear_cross_entropy(h1, w1, targets, label_smoothing=smoothing, chunk=chunk, float8=True)
    (2 * loss).backward()
    h2, w2 = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    exact = h2 @ w2.t()
    logits = exact + (_float8_logits(hidden, weight) - exact).detach()  # the float8 values forward, the GEMM's gradient backward
    ref = F.cross_entropy(logits.float(), targets, label_smoothing=smoothing)
    (2 * ref).backward()

    torch.testing.assert_close(loss, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(h1.grad.float(), h2.grad.float(), atol=atol, rtol=rtol)
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), atol=atol, rtol=rtol)
    assert h1.grad.dtype == dtype and w1.grad.dtype == dtype
    # and the float8 logits are not the input dtype's: the loss moved, by e4m3's rounding only
    plain = fused_linear_cross_entropy(hidden, weight, targets, label_smoothing=smoothing, chunk=chunk)
    assert loss.item() != plain.item() and abs(loss.item() - plain.item()) < 0.02 * plain.item()


def test_a_float8_head_needs_its_sizes_multiples_of_16_and_says_so():
    hidden, targets = torch.randn(4, 24, device=DEVICE), torch.zeros(4, dtype=torch.long, device=DEVICE)
    with pytest.raises(ValueError, match=r"multiples of 16 .* got dim 24, vocab 32"):
        fused_linear_cross_entropy(hidden, torch.randn(32, 24, device=DEVICE), targets, float8=True)
    head = LinearCrossEntropyHead(torch.nn.Parameter(torch.randn(48, 16, device=DEVICE)))
    head.float8 = True
    assert "float8" in repr(head)
    torch.testing.assert_close(head(hidden[:, :16]), hidden[:, :16] @ head.weight.t())  # forward's logits stay the plain GEMM's
