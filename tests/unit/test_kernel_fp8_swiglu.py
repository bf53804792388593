"""kernels/triton/fp8_swiglu.py: the SwiGLU MLP as one float8 function against the three float8 linears
and the activation it replaces (Triton's interpreter and torch._scaled_mm on a CPU; the same tests on a
GPU): each cast it adds against the cast of what the unfused modules store, the function's output and
gradients against theirs, and the fold that swaps it in."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from perflab_kernels.triton import fp8_swiglu  # noqa: E402
from perflab_kernels.triton.fp8_linear import Float8RowwiseLinearFunction, rowwise_e4m3, swap_to_float8  # noqa: E402
from perflab_kernels.triton.fp8_swiglu import Float8SwiGLUFunction, fold_swiglu, rowwise_pair_e4m3, swiglu_grad_e4m3  # noqa: E402
from src.models.layers import SwiGLUFeedForward  # noqa: E402
from tests.unit.test_kernel_fp8_linear import _bits, _silu_as_stored, _within_an_e4m3_step  # noqa: E402  (the same checks as the linear's casts)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _gate_up(rows: int, hidden: int, seed: int) -> torch.Tensor:
    """[G | U] (rows, 2 * hidden) bf16, as the fused gate/up GEMM writes it: G mostly in SiLU's curved
    part, one row all zeros (amax at the floor)."""
    g = torch.Generator().manual_seed(seed)
    gu = torch.randn(rows, 2 * hidden, generator=g) * 2
    gu[1] = 0
    return gu.to(DEVICE, torch.bfloat16)


@pytest.mark.parametrize("rows,hidden,max_block", [(5, 123, None), (3, 300, 64)], ids=["5x123", "3x300-chunked"])
def test_rowwise_cast_with_swiglu_casts_the_activation_as_stored(rows, hidden, max_block, monkeypatch):
    """act="swiglu" on the halves of one [G | U] tensor (strided views, as the MLP hands them): the cast
    of silu(G) * U as eager stores it (silu(G) rounded to bf16, then the product)."""
    from perflab_kernels.triton import fp8_linear

    if max_block:
        monkeypatch.setattr(fp8_linear, "MAX_BLOCK", max_block)
    gu = _gate_up(rows, hidden, seed=1)
    g, u = gu[:, :hidden], gu[:, hidden:]
    y8, inv = rowwise_e4m3(g, "swiglu", u)
    ref8, ref_inv = rowwise_e4m3(_silu_as_stored(g) * u)
    assert torch.equal(inv, ref_inv)
    _within_an_e4m3_step(y8, ref8)
    with pytest.raises(ValueError, match="reads u beside x, of one shape"):
        rowwise_e4m3(g, "swiglu", u[:, 1:])


@pytest.mark.parametrize("shapes,max_block", [(((48, 80), (16, 80)), None), (((7, 300), (5, 300)), 64)], ids=["48+16x80", "7+5x300-chunked"])
def test_the_pair_cast_is_the_rowwise_cast_of_the_stacked_rows(shapes, max_block, monkeypatch):
    if max_block:
        monkeypatch.setattr(fp8_swiglu, "MAX_BLOCK", max_block)
    g = torch.Generator().manual_seed(2)
    a, b = (torch.randn(s, generator=g).to(DEVICE, torch.bfloat16) for s in shapes)
    y8, inv = rowwise_pair_e4m3(a, b)
    ref8, ref_inv = rowwise_e4m3(torch.cat([a, b]))
    assert torch.equal(_bits(y8), _bits(ref8)) and torch.equal(inv, ref_inv)
    with pytest.raises(ValueError, match="stacks rows of one width"):
        rowwise_pair_e4m3(a, b[:, 1:])


@pytest.mark.parametrize("rows,hidden,grad_block", [(6, 80, None), (4, 200, 64)], ids=["6x80", "4x200-chunked"])
def test_the_gradient_cast_is_the_rowwise_cast_of_eagers_dg_and_du(rows, hidden, grad_block, monkeypatch):
    """swiglu_grad_e4m3(dH, [G | U]): the rowwise cast of [dG | dU] as eager's backward of
    silu(G) * U stores them in bf16 (dU = dH * silu(G); dG = silu_backward(dH * U, G)), one scale
    for each row across both halves."""
    if grad_block:
        monkeypatch.setattr(fp8_swiglu, "GRAD_BLOCK", grad_block)
    gu = _gate_up(rows, hidden, seed=3)
    g, u = gu[:, :hidden], gu[:, hidden:]
    dh = torch.randn(rows, hidden, generator=torch.Generator().manual_seed(4)).to(DEVICE, torch.bfloat16)
    du = dh * _silu_as_stored(g)
    dg = torch.ops.aten.silu_backward(dh * u, g)
    y8, inv = swiglu_grad_e4m3(dh, gu)
    ref8, ref_inv = rowwise_e4m3(torch.cat([dg, du], dim=-1))
    assert y8.shape == (rows, 2 * hidden) and torch.equal(inv, ref_inv)
    _within_an_e4m3_step(y8, ref8)
    with pytest.raises(ValueError, match=r"reads \[G \| U\] of shape"):
        swiglu_grad_e4m3(dh, gu[:, 2:])


def _mlp_inputs(tokens=(2, 24), dim=64, hidden=96):
    g = torch.Generator().manual_seed(5)
    x = torch.randn(*tokens, dim, generator=g).to(DEVICE, torch.bfloat16)
    w_gate, w_up = ((torch.randn(hidden, dim, generator=g) * 0.1).to(DEVICE, torch.bfloat16) for _ in range(2))
    w_down = (torch.randn(dim, hidden, generator=g) * 0.1).to(DEVICE, torch.bfloat16)
    dy = torch.randn(*tokens, dim, generator=g).to(DEVICE, torch.bfloat16)
    return x, w_gate, w_up, w_down, dy


def test_the_function_follows_the_three_float8_linears_and_the_activation():
    """Float8SwiGLUFunction against gate, up and down as float8 linears (rowwise_with_gw_tensorwise)
    with silu(g) * u between them: the same output to float8's rounding of the casts computed in
    another order, the same gradients for x and each weight (dx through one GEMM over [dG | dU]
    against two summed), and both within float8's error of exact fp32 math."""
    x, w_gate, w_up, w_down, dy = _mlp_inputs()
    leaves = [t.clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    y = Float8SwiGLUFunction.apply(*leaves)
    y.backward(dy)
    ref_leaves = [t.clone().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    rx, rg, ru, rd = ref_leaves
    lin = Float8RowwiseLinearFunction.apply
    ref = lin(F.silu(lin(rx, rg, None, True)) * lin(rx, ru, None, True), rd, None, True)
    ref.backward(dy)
    assert y.shape == ref.shape and y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref, atol=3e-2, rtol=3e-2)
    for got, want in zip(leaves, ref_leaves):
        assert got.grad.shape == want.grad.shape and got.grad.dtype == want.grad.dtype
        torch.testing.assert_close(got.grad, want.grad, atol=3e-2, rtol=3e-2)
        assert ((got.grad.float() - want.grad.float()).norm() / want.grad.float().norm()).item() < 0.02
    exact = [t.float().requires_grad_() for t in (x, w_gate, w_up, w_down)]
    ex, eg, eu, ed = exact
    (F.linear(F.silu(F.linear(ex, eg)) * F.linear(ex, eu), ed) * dy.float()).sum().backward()
    for got, want in zip(leaves, exact):
        assert ((got.grad.float() - want.grad).norm() / want.grad.norm()).item() < 0.08


def test_the_fold_swaps_a_swiglu_mlp_of_float8_linears_and_keeps_its_parameters():
    """fold_swiglu on SwiGLUFeedForward whose three linears are float8 with a float8 grad weight: its
    class becomes a Float8SwiGLUFeedForward (one class for every such MLP), its parameters and state
    dict stay, and its output follows the unfolded MLP's. An MLP whose linears run the grad weight in
    bf16, or are not all float8, is left alone; a folded one is not folded again."""
    x, *_ = _mlp_inputs()
    torch.manual_seed(0)
    mlp = SwiGLUFeedForward(64, 96).to(DEVICE, torch.bfloat16)
    for lin in (mlp.gate, mlp.up, mlp.down):
        swap_to_float8(lin, float8_grad_weight=True)
    before, params, state = mlp(x), dict(mlp.named_parameters()), {k: v.clone() for k, v in mlp.state_dict().items()}
    assert fold_swiglu(mlp) and not fold_swiglu(mlp)
    assert type(mlp).__name__ == "Float8SwiGLUFeedForward" and isinstance(mlp, SwiGLUFeedForward)
    assert dict(mlp.named_parameters()) == params and mlp.state_dict().keys() == state.keys()
    after = mlp(x)
    assert ((after.float() - before.float()).norm() / before.float().norm()).item() < 0.01
    other = SwiGLUFeedForward(64, 96).to(DEVICE, torch.bfloat16)
    for lin in (other.gate, other.up, other.down):
        swap_to_float8(lin, float8_grad_weight=True)
    assert fold_swiglu(other) and type(other) is type(mlp)
    hp = SwiGLUFeedForward(64, 96)
    for lin in (hp.gate, hp.up, hp.down):
        swap_to_float8(lin, float8_grad_weight=False)
    partial = SwiGLUFeedForward(64, 96)
    swap_to_float8(partial.down, float8_grad_weight=True)
    assert not fold_swiglu(hp) and not fold_swiglu(partial) and type(hp) is SwiGLUFeedForward


def test_a_llama_block_converted_with_the_fold_trains_as_the_unfolded_one():
    """convert_blocks_to_float8(fold_activation=True) on a tiny LLaMA 3 model (GQA, SwiGLU): every
    block's MLP folds, and one forward and backward gives the unfolded model's loss and gradients to
    float8's rounding."""
    from src.distributed.float8 import convert_blocks_to_float8
    from src.models.llama3.model import Llama3

    def run(fold: bool):
        torch.manual_seed(0)
        model = Llama3(vocab_size=64, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_hidden=96).to(DEVICE, torch.bfloat16)
        convert_blocks_to_float8(model, "rowwise_with_gw_tensorwise", False, impl="triton", fold_activation=fold)
        tokens = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
        loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
        loss.backward()
        return model, loss, {n: p.grad for n, p in model.named_parameters()}

    folded, loss, grads = run(True)
    assert all(type(b.ffn).__name__ == "Float8SwiGLUFeedForward" for b in folded.layers)
    unfolded, ref_loss, ref_grads = run(False)
    assert all(type(b.ffn) is SwiGLUFeedForward for b in unfolded.layers)
    torch.testing.assert_close(loss, ref_loss, atol=1e-2, rtol=1e-2)
    assert grads.keys() == ref_grads.keys()
    for name, g in grads.items():
        assert ((g.float() - ref_grads[name].float()).norm() / ref_grads[name].float().norm()).item() < 0.03, name


@pytest.mark.parametrize("fast_accum", [False, True], ids=["output-only", "every-gemm"])
def test_fast_accumulation_reaches_the_gemms_it_names(fast_accum, monkeypatch):
    """precision.fp8_fast_accum through convert_blocks_to_float8 on a tiny LLaMA 3 model (the folded
    SwiGLU function and the attention's plain float8 linears): forward's GEMMs always accumulate fast
    (torchao's default for the output GEMM), backward's grad-input and grad-weight GEMMs only with it on."""
    from src.distributed.float8 import convert_blocks_to_float8
    from src.models.llama3.model import Llama3

    torch.manual_seed(0)
    model = Llama3(vocab_size=64, dim=64, n_layers=1, n_heads=4, n_kv_heads=2, ffn_hidden=96).to(DEVICE, torch.bfloat16)
    convert_blocks_to_float8(model, "rowwise_with_gw_tensorwise", False, impl="triton", fold_activation=True, fast_accum=fast_accum)
    assert type(model.layers[0].ffn).__name__ == "Float8SwiGLUFeedForward"
    calls, scaled_mm = [], torch._scaled_mm
    monkeypatch.setattr(torch, "_scaled_mm", lambda *a, **k: calls.append(k["use_fast_accum"]) or scaled_mm(*a, **k))
    tokens = torch.randint(0, 64, (1, 17), generator=torch.Generator().manual_seed(1)).to(DEVICE)
    loss = F.cross_entropy(model(tokens[:, :-1]).flatten(0, 1).float(), tokens[:, 1:].flatten())
    forward = list(calls)
    loss.backward()
    backward = calls[len(forward):]
    # forward: the attention's linears (q, k, v, o as the model has them) and the MLP's two GEMMs
    assert forward and all(forward)
    # backward: two GEMMs a linear (grad input, grad weight), four for the MLP's function
    assert len(backward) == 2 * len(forward) and all(b is fast_accum for b in backward)
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
