"""Fused Triton cross-entropy against torch's, loss and gradient, odd shapes, ignore_index, label smoothing."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

triton = pytest.importorskip("triton")

from perflab_kernels.triton.cross_entropy import FusedCrossEntropyLoss, fused_cross_entropy  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (1e-2, 2e-2)}


@pytest.mark.parametrize("smoothing", [0.0, 0.1], ids=["plain", "smoothed"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,vocab", [(5, 123), (21, 257), (3, 5000), (8, 32000)])
def test_loss_and_gradient_match_torch(rows, vocab, dtype, smoothing):
    torch.manual_seed(0)
    atol, rtol = TOLERANCE[dtype]
    logits = (torch.randn(rows, vocab, device=DEVICE) * 4).to(dtype)
    targets = torch.randint(0, vocab, (rows,), device=DEVICE)
    targets[1] = -100  # ignored: no loss, no gradient, not counted in the mean

    ours_in = logits.clone().requires_grad_()
    loss = fused_cross_entropy(ours_in * 1, targets, label_smoothing=smoothing)  # *1: the kernel overwrites its input buffer
    (loss * 3).backward()
    ref_in = logits.clone().float().requires_grad_()
    ref = F.cross_entropy(ref_in, targets, ignore_index=-100, label_smoothing=smoothing)
    (ref * 3).backward()

    torch.testing.assert_close(loss, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad, atol=atol, rtol=rtol)
    assert torch.all(ours_in.grad[1] == 0)


def test_every_target_ignored_gives_zero_loss_and_gradient():
    logits = torch.randn(4, 50, device=DEVICE, requires_grad=True)
    loss = fused_cross_entropy(logits * 1, torch.full((4,), -100, device=DEVICE))
    loss.backward()
    assert loss.item() == 0 and torch.all(logits.grad == 0)


def test_module_is_a_drop_in_for_nn_cross_entropy_loss():
    logits = torch.randn(6, 40, device=DEVICE)
    targets = torch.tensor([1, 2, -1, 3, 39, 0], device=DEVICE)
    ours = FusedCrossEntropyLoss(ignore_index=-1, label_smoothing=0.2)(logits.clone(), targets)
    ref = torch.nn.CrossEntropyLoss(ignore_index=-1, label_smoothing=0.2)(logits, targets)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_row_in_registers_variant_matches_torch(monkeypatch, dtype):
    """Rows up to ROW_IN_REGISTERS_MAX wide are read once into registers instead of in blocks."""
    import perflab_kernels.triton.cross_entropy as ce

    monkeypatch.setattr(ce, "ROW_IN_REGISTERS_MAX", 4096)
    assert ce.launch_settings(3000)[2] and not ce.launch_settings(5000)[2]
    torch.manual_seed(2)
    atol, rtol = TOLERANCE[dtype]
    logits = (torch.randn(7, 3000, device=DEVICE) * 4).to(dtype)
    targets = torch.randint(0, 3000, (7,), device=DEVICE)
    targets[3] = -100
    ours_in = logits.clone().requires_grad_()
    loss = fused_cross_entropy(ours_in * 1, targets, label_smoothing=0.1)
    loss.backward()
    ref_in = logits.clone().float().requires_grad_()
    ref = F.cross_entropy(ref_in, targets, label_smoothing=0.1)
    ref.backward()
    torch.testing.assert_close(loss, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(ours_in.grad.float(), ref_in.grad, atol=atol, rtol=rtol)


def test_a_unit_incoming_gradient_leaves_the_fused_gradient_as_written():
    """loss.backward() passes 1: backward skips its scaling pass on the device, the gradient is the
    one the forward kernel wrote; any other incoming gradient scales it in place."""
    from perflab_kernels.triton.cross_entropy import scale_unless_one_

    t = torch.randn(3, 1000, device=DEVICE)
    before = t.clone()
    scale_unless_one_(t, torch.tensor(1.0, device=DEVICE))
    assert torch.equal(t, before)
    scale_unless_one_(t, torch.tensor(-2.5, device=DEVICE))
    torch.testing.assert_close(t, before * -2.5)
