"""Fused linear + cross-entropy equals the unfused head and loss: loss, grad of hidden and weight."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from kernels.triton.linear_cross_entropy import (  # noqa: E402
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
