"""mini_llm's attention takes q, k, v off the token axis (`unbind(2)`, then each transposed) so that
backward stacks their gradients in one contiguous copy; the numbers are those of the head-major
formulation (`permute(2, 0, 3, 1, 4).unbind(0)`), bit for bit, with and without the causal mask."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from src.models.mini_llm.model import Attention


def _head_major(attn: Attention, x: torch.Tensor) -> torch.Tensor:
    B, T, C = x.shape
    qkv = attn.in_proj(x).view(B, T, 3, attn.n_heads, C // attn.n_heads)
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    y = F.scaled_dot_product_attention(q, k, v, is_causal=attn.causal)
    return attn.out_proj(y.transpose(1, 2).reshape(B, T, C))


@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_token_major_qkv_gives_the_head_major_numbers(causal):
    torch.manual_seed(0)
    attn = Attention(96, 6, causal)
    x = torch.randn(3, 11, 96, requires_grad=True)
    dy = torch.randn(3, 11, 96)
    leaves = [x, *attn.parameters()]
    y = attn(x)
    grads = torch.autograd.grad(y, leaves, dy)
    y_ref = _head_major(attn, x)
    grads_ref = torch.autograd.grad(y_ref, leaves, dy)
    assert torch.equal(y, y_ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, grads_ref))
