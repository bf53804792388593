"""kernels/triton/fp8_linear.py: the e4m3 casts bit for bit against torch's cast of the same scaled
values, and the float8 linear's forward and backward against the recipe computed in torch (Triton's
interpreter and torch._scaled_mm on a CPU; the same tests on a GPU)."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("triton")

from perflab_kernels.triton import device, fp8_linear  # noqa: E402
from perflab_kernels.triton.fp8_linear import (  # noqa: E402
    E4M3,
    Float8RowwiseLinear,
    Float8RowwiseLinearFunction,
    rowwise_e4m3,
    swap_to_float8,
    transposed_e4m3,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _pow2_scale(amax: torch.Tensor) -> torch.Tensor:
    """The largest power of two s with amax * s <= 448, by frexp (amax = m * 2**e, m in [0.5, 1))."""
    mant, exp = torch.frexp(amax.float().clamp(min=1e-12))
    return torch.exp2((9 - exp - (mant > 0.875).int()).float())


def _cast(t: torch.Tensor, dim: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(e4m3 values, fp32 scales): torch's own cast of t times the recipe's power-of-two scale, a
    scale a slice along `dim` or one for the tensor."""
    amax = t.float().abs().amax() if dim is None else t.float().abs().amax(dim=dim, keepdim=True)
    s = _pow2_scale(amax)
    return (t.float() * s).to(E4M3), s


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8)


def _inputs(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.logspace(-3, 2, shape[-1])  # columns from 1e-3 to 1e2: subnormals after scaling
    x[1] = 0  # an all-zero row: amax at the floor, zeros out
    return x.to(device=DEVICE, dtype=dtype)


@pytest.mark.parametrize("rows", [1, 4], ids=["row-a-program", "4-rows-a-program"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape,max_block", [((5, 123), None), ((17, 64), None), ((3, 300), 64)], ids=["5x123", "17x64", "3x300-chunked"])
def test_rowwise_cast_is_torchs_cast_of_the_scaled_rows(shape, max_block, dtype, rows, monkeypatch):
    if max_block:
        monkeypatch.setattr(fp8_linear, "MAX_BLOCK", max_block)  # a row in 5 chunks: the two-pass path
    monkeypatch.setattr(fp8_linear, "ROWWISE_ROWS", rows)  # 5 and 17 rows in tiles of 4: the last tile ragged
    monkeypatch.setattr(device, "INTERPRETER_ROWS", 1)  # the tiles asked for, in the interpreter too
    x = _inputs(shape, dtype)
    y8, inv = rowwise_e4m3(x)
    ref, s = _cast(x, 1)
    assert y8.dtype == E4M3 and inv.shape == (shape[0], 1)
    assert torch.equal(_bits(y8), _bits(ref))
    assert torch.equal(inv, 1 / s)  # powers of two: exact
    row_amax = y8.float().abs().amax(1)
    assert row_amax[1] == 0 and (row_amax[torch.arange(shape[0], device=DEVICE) != 1] >= 224).all()  # each nonzero row fills e4m3's upper half


@pytest.mark.parametrize("tile,of,walk", [((64, 64), "e4m3", "down"), ((128, 64), "fp32", "across"), ((32, 128), "input", "across_from_end"),
                                         ((16, 16), "e4m3", "across")],
                         ids=["64x64-down", "128x64-fp32-transposed-across", "32x128-input-transposed-from-the-end", "16x16-whole-tiles"])
@pytest.mark.parametrize("shape", [(48, 80), (70, 33)], ids=["48x80", "70x33-ragged-tiles"])
def test_transposed_cast_is_torchs_cast_with_one_scale(shape, tile, of, walk, monkeypatch):
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_TILE", tile)
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_OF", of)
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_WALK", walk)
    w = _inputs(shape, torch.bfloat16, seed=1)
    _, row_inv = rowwise_e4m3(w)
    wt8, inv, inv_max = transposed_e4m3(w, row_inv)
    ref, s = _cast(w, None)
    assert wt8.shape == (shape[1], shape[0]) and inv.shape == (1, shape[1])
    assert torch.equal(_bits(wt8), _bits(ref.t().contiguous()))
    assert torch.equal(inv, (1 / s).expand(1, shape[1])) and torch.equal(inv_max, 1 / s)


def _one_subnormal_step_at_most(a8: torch.Tensor, b8: torch.Tensor) -> torch.Tensor:
    """Where a8 and b8 differ: both among e4m3's subnormals (|v| < 2**-6), zero, or the smallest
    normal value that the largest subnormal rounds up to, one subnormal step (2**-9) apart.
    Returns where they differ."""
    a, b = a8.float(), b8.float()
    differ = _bits(a8) != _bits(b8)
    assert (a[differ].abs() <= 2**-6).all() and (b[differ].abs() <= 2**-6).all()
    assert ((a - b).abs()[differ] == 2**-9).all()
    return differ


@pytest.mark.parametrize("tile,of", [((64, 64), "e4m3"), ((32, 128), "input"), ((16, 16), "fp32")],
                         ids=["64x64-rescaled-tile-transposed", "32x128-bytes-transposed", "16x16-whole-tiles"])
@pytest.mark.parametrize("shape", [(48, 80), (70, 33)], ids=["48x80", "70x33-ragged-tiles"])
def test_transposed_cast_from_the_rowwise_cast_is_the_cast_of_the_input(shape, tile, of, monkeypatch):
    """TRANSPOSE_FROM="e4m3": W^T cast from the rowwise cast's bytes and row scales (each value times
    2**-k, k the row's scale over the tensor's) is the cast of W itself: the same bits wherever the
    result is normal, and where it is subnormal one step apart at most (the first rounding made a tie
    of the second). The rows whose scale is the tensor's (k = 0) are the same bits throughout."""
    monkeypatch.setattr(fp8_linear, "FROM_E4M3_TILE", tile)
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_OF", of)
    w = _inputs(shape, torch.bfloat16, seed=1)
    w[5] *= 64  # one row's amax 64x the others': the others' rows rescaled by 2**-6 or so
    w8, row_inv = rowwise_e4m3(w)
    wt8, inv, inv_max = transposed_e4m3(w, row_inv, w8=w8)
    ref8, ref_inv, ref_max = transposed_e4m3(w, row_inv)  # from W, as torch casts it (the test above)
    assert torch.equal(inv, ref_inv) and torch.equal(inv_max, ref_max)
    differ = _one_subnormal_step_at_most(wt8, ref8)
    assert differ.any()  # these inputs do reach the ties (4-5% of the elements)
    assert not differ[:, (row_inv == inv_max).flatten()].any()
    assert differ.float().mean() < 0.1
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_FROM", "input")  # the switch: W read again, the bits of the cast of W
    assert torch.equal(_bits(transposed_e4m3(w, row_inv, w8=w8)[0]), _bits(ref8))


@pytest.mark.parametrize("shape,tile,of,walk", [((48, 80), (32, 32), "e4m3", "down"), ((64, 32), (64, 16), "input", "across_from_end")],
                         ids=["48x80-ragged-tiles", "64x32-input-transposed-from-the-end"])
def test_transposed_cast_by_tma_is_the_same_cast(shape, tile, of, walk, monkeypatch):
    """The TMA kernel: tiles past W's edges loaded as zeros and stored clipped (48 rows in tiles of 32)."""
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_TILE", tile)
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_OF", of)
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_WALK", walk)
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_TMA", True)
    if DEVICE == "cpu":  # the interpreter moves descriptors' tiles too; on a GPU _tma_fits decides (these shapes fit)
        monkeypatch.setattr(fp8_linear, "_tma_fits", lambda w, wt: True)
    w = _inputs(shape, torch.bfloat16, seed=2)
    _, row_inv = rowwise_e4m3(w)
    wt8, inv, inv_max = transposed_e4m3(w, row_inv)
    ref, s = _cast(w, None)
    assert torch.equal(_bits(wt8), _bits(ref.t().contiguous()))
    assert torch.equal(inv, (1 / s).expand(1, shape[1])) and torch.equal(inv_max, 1 / s)


@pytest.mark.parametrize("float8_grad_weight", [False, True], ids=["gw_hp", "gw_tensorwise"])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "nobias"])
def test_float8_linear_forward_and_backward_follow_the_recipe(bias, float8_grad_weight):
    """Forward: the output GEMM on the recipe's float8 values (fp32 accumulation, so equal to
    rounding). Backward: dX from float8 dY (a scale a row) and W (one scale); dW in the input's
    dtype as eager's, or from float8 dY^T and X^T (one scale each); db as eager's. Against exact
    fp32 math dX and a float8 dW are within float8's error (< 8%)."""
    g = torch.Generator().manual_seed(0)
    x = (torch.randn(3, 16, 48, generator=g)).to(DEVICE, torch.bfloat16).requires_grad_()
    w = (torch.randn(80, 48, generator=g) * 0.05).to(DEVICE, torch.bfloat16).requires_grad_()
    b = (torch.randn(80, generator=g) * 0.1).to(DEVICE, torch.bfloat16).requires_grad_() if bias else None
    dy = torch.randn(3, 16, 80, generator=g).to(DEVICE, torch.bfloat16)

    y = Float8RowwiseLinearFunction.apply(x, w, b, float8_grad_weight)
    y.backward(dy)

    x8, sx = _cast(x.detach().reshape(-1, 48), 1)
    w8, sw = _cast(w.detach(), 1)
    ref = (x8.float() / sx) @ (w8.float() / sw).t()
    ref = ref.to(torch.bfloat16) + (b.detach() if bias else 0)
    torch.testing.assert_close(y.reshape(-1, 80), ref, atol=1e-2, rtol=1e-2)  # fast accumulation on a GPU

    dy8, sdy = _cast(dy.reshape(-1, 80), 1)
    wt8, swt = _cast(w.detach(), None)
    dx_ref = ((dy8.float() / sdy) @ (wt8.float() / swt)).to(torch.bfloat16)
    torch.testing.assert_close(x.grad.reshape(-1, 48), dx_ref, atol=1e-2, rtol=1e-2)
    if float8_grad_weight:
        dyt8, sdyt = _cast(dy.reshape(-1, 80), None)
        xt8, sxt = _cast(x.detach().reshape(-1, 48), None)
        dw_ref = ((dyt8.float() / sdyt).t() @ (xt8.float() / sxt)).to(torch.bfloat16)
        torch.testing.assert_close(w.grad, dw_ref, atol=1e-2, rtol=1e-2)
        exact_dw = dy.float().reshape(-1, 80).t() @ x.detach().float().reshape(-1, 48)
        assert ((w.grad.float() - exact_dw).norm() / exact_dw.norm()).item() < 0.08
    else:
        torch.testing.assert_close(w.grad, (dy.reshape(-1, 80).t() @ x.detach().reshape(-1, 48)), atol=0, rtol=0)
    if bias:
        torch.testing.assert_close(b.grad, dy.reshape(-1, 80).sum(0), atol=0, rtol=0)

    exact = dy.float().reshape(-1, 80) @ w.detach().float()
    assert ((x.grad.float().reshape(-1, 48) - exact).norm() / exact.norm()).item() < 0.08


def test_swap_keeps_the_parameters_and_takes_only_a_plain_linear():
    lin = torch.nn.Linear(32, 16, bias=True, device=DEVICE, dtype=torch.bfloat16)
    params = dict(lin.named_parameters())
    swap_to_float8(lin, float8_grad_weight=True)
    assert type(lin) is Float8RowwiseLinear and dict(lin.named_parameters()) == params and lin.float8_grad_weight
    x = torch.randn(16, 32, device=DEVICE, dtype=torch.bfloat16)
    assert ((lin(x).float() - F.linear(x, lin.weight, lin.bias).float()).norm() / F.linear(x, lin.weight, lin.bias).float().norm()) < 0.08
    with pytest.raises(TypeError, match="plain nn.Linear, not Float8RowwiseLinear"):
        swap_to_float8(lin)


def _silu_as_stored(u: torch.Tensor) -> torch.Tensor:
    """SiLU computed in fp32 as x / (1 + e^-x) and rounded to u's dtype, as the activation's own
    kernel stores it (and as fp8_linear._act rounds it before the cast)."""
    uf = u.float()
    return (uf / (1 + torch.exp(-uf))).to(u.dtype)


def _within_an_e4m3_step(a8: torch.Tensor, b8: torch.Tensor) -> None:
    """The same e4m3 bits: exactly in the interpreter (fp32 exp and an exact division on both
    sides); on a GPU but where Triton's approximate division (2 ulp) or torch's exp round apart
    from the other side's, which moves a value by at most one e4m3 step (1/8 of the larger's power
    of two)."""
    if DEVICE == "cpu":
        assert torch.equal(_bits(a8), _bits(b8))
        return
    a, b = a8.float(), b8.float()
    differ = a != b
    assert differ.float().mean() < 0.01
    assert ((a - b).abs()[differ] <= torch.maximum(a.abs(), b.abs())[differ] / 8 + 2**-9).all()


@pytest.mark.parametrize("shape,max_block", [((5, 123), None), ((3, 300), 64)], ids=["5x123", "3x300-chunked"])
def test_rowwise_cast_with_silu_casts_the_activation_as_stored(shape, max_block, monkeypatch):
    """act="silu": the cast of silu(U) as SiLU's own kernel would store it in bf16, from U."""
    if max_block:
        monkeypatch.setattr(fp8_linear, "MAX_BLOCK", max_block)
    u = _inputs(shape, torch.bfloat16, seed=3) * 0.05  # SiLU's curved part (|u| < 5) for most elements
    y8, inv = rowwise_e4m3(u, "silu")
    ref8, ref_inv = rowwise_e4m3(_silu_as_stored(u))
    assert torch.equal(inv, ref_inv)
    _within_an_e4m3_step(y8, ref8)
    assert not torch.equal(_bits(y8), _bits(rowwise_e4m3(u)[0]))  # the activation was applied


@pytest.mark.parametrize("shape", [(48, 80), (70, 33)], ids=["48x80", "70x33-ragged-tiles"])
def test_transposed_cast_with_silu_casts_the_activation_as_stored(shape):
    u = _inputs(shape, torch.bfloat16, seed=4) * 0.05
    _, row_inv = rowwise_e4m3(u, "silu")
    wt8, inv, inv_max = transposed_e4m3(u, row_inv, "silu")
    ref8, ref_inv, ref_max = transposed_e4m3(_silu_as_stored(u), rowwise_e4m3(_silu_as_stored(u))[1])
    assert torch.equal(inv, ref_inv) and torch.equal(inv_max, ref_max)
    _within_an_e4m3_step(wt8, ref8)
    u8, _ = rowwise_e4m3(u, "silu")  # from the rowwise cast of silu(U), as the linear casts X^T: SiLU is in its bytes
    _one_subnormal_step_at_most(transposed_e4m3(u, row_inv, "silu", w8=u8)[0], transposed_e4m3(_silu_as_stored(u), row_inv)[0])


@pytest.mark.parametrize("float8_grad_weight", [False, True], ids=["gw_hp", "gw_tensorwise"])
def test_float8_linear_with_silu_is_silu_then_the_float8_linear(float8_grad_weight):
    """down(silu(u)) with SiLU inside down's casts against SiLU as its own op before the same float8
    linear: the output, dU (through SiLU's gradient) and dW, to float8's rounding of the few
    elements whose fp32 sigmoid differs by an ulp."""
    g = torch.Generator().manual_seed(5)
    u = (torch.randn(2, 24, 64, generator=g) * 2).to(DEVICE, torch.bfloat16)
    w = (torch.randn(48, 64, generator=g) * 0.05).to(DEVICE, torch.bfloat16)  # every GEMM size a multiple of 16 (_scaled_mm on a GPU)
    dy = torch.randn(2, 24, 48, generator=g).to(DEVICE, torch.bfloat16)

    u1, w1 = u.clone().requires_grad_(), w.clone().requires_grad_()
    y1 = Float8RowwiseLinearFunction.apply(u1, w1, None, float8_grad_weight, "silu")
    y1.backward(dy)
    u2, w2 = u.clone().requires_grad_(), w.clone().requires_grad_()
    y2 = Float8RowwiseLinearFunction.apply(F.silu(u2), w2, None, float8_grad_weight)
    y2.backward(dy)
    torch.testing.assert_close(y1, y2, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(u1.grad, u2.grad, atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(w1.grad, w2.grad, atol=2e-2, rtol=2e-2)
    assert ((y1.float() - y2.float()).norm() / y2.float().norm()).item() < 0.01


def test_the_seed_mlps_silu_and_nothing_else_folds_into_the_down_casts():
    from src.models.mini_llm.model import FeedForward, SwiGLUFeedForward

    torch.manual_seed(0)
    mlp = FeedForward(32, 64).to(DEVICE, torch.bfloat16)
    x = torch.randn(4, 16, 32, device=DEVICE, dtype=torch.bfloat16)
    for lin in (mlp.up, mlp.down):
        swap_to_float8(lin, float8_grad_weight=True)
    params = dict(mlp.named_parameters())
    before = mlp(x)
    assert fp8_linear.fold_mlp_activation(mlp) and not fp8_linear.fold_mlp_activation(mlp)  # once
    assert type(mlp.act) is torch.nn.Identity and mlp.down.act == "silu" and mlp.up.act is None
    assert dict(mlp.named_parameters()) == params and "act=silu" in repr(mlp.down)
    after = mlp(x)
    assert ((after.float() - before.float()).norm() / before.float().norm()).item() < 0.01
    swiglu = SwiGLUFeedForward(32, 64)
    swap_to_float8(swiglu.down)
    assert not fp8_linear.fold_mlp_activation(swiglu) and swiglu.down.act is None  # silu(g) * u: two inputs, nothing folded
    plain = FeedForward(32, 64)
    assert not fp8_linear.fold_mlp_activation(plain)  # down not float8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("rows,width,pieces", [(7, 40, 3), (9, 64, 2), (5, 123, 1), (2, 16, 3)], ids=["7x3x40", "9x2x64", "5x123", "2x3x16"])
def test_the_pieces_cast_is_the_rowwise_cast_of_their_concatenation(rows, width, pieces, dtype):
    """dY's cast over pieces read side by side (in_proj's dq, dk, dv): the same bits and scales as
    the rowwise cast of the concatenated tensor, from pieces that are views with their own row
    strides, rows not a multiple of the programs' share (the last program's share ragged); the column
    sums those of the concatenation in fp32 (the bias gradient before rounding), to fp32's summation order."""
    whole = _inputs((rows, width * pieces + 5), dtype)  # 5 columns past the pieces: each piece's rows 5 + width * pieces apart
    parts = [whole[:, i * width:(i + 1) * width] for i in range(pieces)]
    cat = torch.cat(parts, dim=-1)
    y8, inv, sums = fp8_linear.rowwise_e4m3_pieces(parts, col_sum=True)
    ref8, ref_inv = rowwise_e4m3(cat)
    assert torch.equal(_bits(y8), _bits(ref8)) and torch.equal(inv, ref_inv)
    torch.testing.assert_close(sums, cat.float().sum(0), atol=1e-5, rtol=1e-5)
    y8, inv, none = fp8_linear.rowwise_e4m3_pieces(parts, col_sum=False)
    assert torch.equal(_bits(y8), _bits(ref8)) and torch.equal(inv, ref_inv) and none is None


def test_the_pieces_cast_outside_its_terms_casts_the_concatenation():
    """Pieces of unequal widths, or more than MAX_PIECES: concatenated first, then the plain cast."""
    x = _inputs((6, 100), torch.bfloat16)
    for parts in ([x[:, :30], x[:, 30:]], [x[:, i * 20:(i + 1) * 20] for i in range(5)]):
        y8, inv, sums = fp8_linear.rowwise_e4m3_pieces(parts, col_sum=True)
        ref8, ref_inv = rowwise_e4m3(torch.cat(parts, dim=-1))
        assert torch.equal(_bits(y8), _bits(ref8)) and torch.equal(inv, ref_inv)
        torch.testing.assert_close(sums, torch.cat(parts, dim=-1).float().sum(0), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("transpose_from", ["e4m3", "input"])
@pytest.mark.parametrize("float8_grad_weight", [False, True], ids=["gw_hp", "gw_tensorwise"])
def test_split_forward_is_forward_in_pieces_with_the_same_gradients(float8_grad_weight, transpose_from, monkeypatch):
    """split_forward(x, 3): forward(x).chunk(3, -1) to the bit, and from the pieces' gradients the same
    dX and dW bits as from their concatenation; db to fp32's summation order, rounded once to bf16."""
    monkeypatch.setattr(fp8_linear, "TRANSPOSE_FROM", transpose_from)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(2, 24, 32, generator=g).to(DEVICE, torch.bfloat16)
    lin = torch.nn.Linear(32, 3 * 16, bias=True).to(DEVICE, torch.bfloat16)
    swap_to_float8(lin, float8_grad_weight)
    dys = [torch.randn(2, 24, 16, generator=g).to(DEVICE, torch.bfloat16) * s for s in (1.0, 30.0, 0.01)]  # the row scale set by the middle piece

    x1 = x.clone().requires_grad_()
    pieces = lin.split_forward(x1, 3)
    torch.autograd.backward(pieces, dys)
    grads = (x1.grad, lin.weight.grad.clone(), lin.bias.grad.clone())
    lin.zero_grad()
    x2 = x.clone().requires_grad_()
    y = lin(x2)
    y.backward(torch.cat(dys, dim=-1))

    assert len(pieces) == 3 and all(torch.equal(p, c) for p, c in zip(pieces, y.chunk(3, -1)))
    assert torch.equal(grads[0], x2.grad) and torch.equal(grads[1], lin.weight.grad)
    torch.testing.assert_close(grads[2], lin.bias.grad, atol=0, rtol=2 ** -8)  # one bf16 rounding apart at most


def test_attention_splits_a_float8_in_proj_and_trains_as_one_projection(monkeypatch):
    """mini_llm's attention with a float8 in_proj takes q, k, v through split_forward; the output
    and every gradient are those of the same linear called whole and chunked (in_proj's bias to
    fp32's summation order)."""
    from src.models.mini_llm.model import Attention

    torch.manual_seed(0)
    attn = Attention(64, 4, causal=True).to(DEVICE, torch.bfloat16)
    swap_to_float8(attn.in_proj, float8_grad_weight=True)
    calls = []
    split = Float8RowwiseLinear.split_forward
    monkeypatch.setattr(Float8RowwiseLinear, "split_forward", lambda self, x, n: calls.append(n) or split(self, x, n))
    x = torch.randn(2, 32, 64, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(2, 32, 64, device=DEVICE, dtype=torch.bfloat16)

    def run():
        xg = x.clone().requires_grad_()
        attn.zero_grad()
        y = attn(xg)
        y.backward(dy)
        return y, xg.grad, {n: p.grad.clone() for n, p in attn.named_parameters()}

    y, dx, grads = run()
    assert calls == [3]
    monkeypatch.setattr(Float8RowwiseLinear, "split_forward", None)  # split_projection's plain path: in_proj(x).chunk(3, -1)
    y_ref, dx_ref, grads_ref = run()
    assert calls == [3] and torch.equal(y, y_ref) and torch.equal(dx, dx_ref)
    for name in grads:
        if name == "in_proj.bias":
            torch.testing.assert_close(grads[name], grads_ref[name], atol=0, rtol=2 ** -8)
        else:
            assert torch.equal(grads[name], grads_ref[name]), name


def _silu_grad_as_stored(dh: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """dU = dH * silu'(U) in fp32 as aten's silu_backward computes it (s = 1 / (1 + e^-u), dH * s *
    (1 + u * (1 - s))), rounded to dH's dtype."""
    uf, s = u.float(), 1 / (1 + torch.exp(-u.float()))
    return (dh.float() * s * (1 + uf * (1 - s))).to(dh.dtype)


@pytest.mark.parametrize("shape,max_block", [((5, 123), None), ((3, 300), 64)], ids=["5x123", "3x300-chunked"])
def test_rowwise_cast_of_silus_gradient_casts_du_as_stored(shape, max_block, monkeypatch):
    """act="silu_grad": the cast of dU = dH * silu'(U), computed from dH and U as SiLU's backward
    stores it in bf16, without dU in memory; the same scales, and aten's silu_backward to a bf16 ulp."""
    if max_block:
        monkeypatch.setattr(fp8_linear, "MAX_BLOCK", max_block)
    u = _inputs(shape, torch.bfloat16, seed=6) * 0.05
    dh = _inputs(shape, torch.bfloat16, seed=7)
    du = _silu_grad_as_stored(dh, u)
    torch.testing.assert_close(du, torch.ops.aten.silu_backward(dh, u), atol=0, rtol=2 ** -7)
    y8, inv = rowwise_e4m3(dh, "silu_grad", u)
    ref8, ref_inv = rowwise_e4m3(du)
    assert torch.equal(inv, ref_inv)
    _within_an_e4m3_step(y8, ref8)


@pytest.mark.parametrize("float8_grad_weight", [False, True], ids=["gw_hp", "gw_tensorwise"])
def test_the_folded_mlp_takes_silus_gradient_in_ups_cast(float8_grad_weight):
    """With up a float8 linear too, the fold pairs them: down's backward hands back d silu(U), and
    up's cast of dY takes SiLU's gradient from U (gw_tensorwise; gw_hp needs dU in bf16 for its grad
    weight, so SiLU's backward runs as its own op in up's backward). Against the fold of SiLU's forward
    alone: the same output and down's gradient, bit for bit; up's and x's to an e4m3 step of dU
    (gw_tensorwise), or bit for bit (gw_hp)."""
    from src.models.mini_llm.model import FeedForward

    torch.manual_seed(1)
    x = torch.randn(2, 16, 32, device=DEVICE, dtype=torch.bfloat16)
    dy = torch.randn(2, 16, 32, device=DEVICE, dtype=torch.bfloat16)

    def run(pair: bool):
        torch.manual_seed(0)
        mlp = FeedForward(32, 64).to(DEVICE, torch.bfloat16)
        for lin in (mlp.up, mlp.down):
            swap_to_float8(lin, float8_grad_weight)
        assert fp8_linear.fold_mlp_activation(mlp)
        assert (mlp.up.act_out, mlp.down.act_grad_by_producer) == ("silu", True) and "act_out=silu" in repr(mlp.up)
        if not pair:
            mlp.up.act_out, mlp.down.act_grad_by_producer = None, False  # SiLU's backward in down's, as before the pairing
        xg = x.clone().requires_grad_()
        y = mlp(xg)
        y.backward(dy)
        return y, xg.grad, mlp.up.weight.grad, mlp.down.weight.grad

    y, dx, dw_up, dw_down = run(pair=True)
    y_ref, dx_ref, dw_up_ref, dw_down_ref = run(pair=False)
    assert torch.equal(y, y_ref) and torch.equal(dw_down, dw_down_ref)
    if float8_grad_weight:
        torch.testing.assert_close(dx, dx_ref, atol=2e-2, rtol=2e-2)
        torch.testing.assert_close(dw_up, dw_up_ref, atol=2e-2, rtol=2e-2)
        assert ((dx.float() - dx_ref.float()).norm() / dx_ref.float().norm()).item() < 0.01
    else:
        assert torch.equal(dx, dx_ref) and torch.equal(dw_up, dw_up_ref)
