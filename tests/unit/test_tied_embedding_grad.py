"""speed.tied_embedding_grad (kernels/triton/embedding_grad.py, src/speed/tied_embedding.py): the
embedding's rows added into the tied head's gradient, summed as torch's CUDA path sums them (against
that algorithm written out in torch here, bit for bit, and torch's own kernels on a GPU), the model
and a one-rank FSDP2 run with it against the same without, and where it refuses or stays off."""
from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

pytest.importorskip("triton")

from perflab_kernels.triton.embedding_grad import (  # noqa: E402
    NROWS,
    TORCH_SORT_PATH_ABOVE,
    TiedEmbedding,
    fold_rows_,
    segments,
    tie_gradient,
    torch_sums_atomically,
)
from src.config.compose import compose_config  # noqa: E402
from tests.support.devices import needs_gpu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def torch_cuda_sum(grad: torch.Tensor, ids: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """grad + the embedding gradient as torch's CUDA sort path computes it (EmbeddingBackwardKernel.cu),
    written out: ids sorted stably; per id, partials of NROWS rows summed in fp32 from zero, the
    partials summed in fp32 from zero, rounded to grad's dtype, added to the row in fp32 and rounded."""
    flat, rows = ids.reshape(-1).cpu(), gy.reshape(-1, grad.shape[1]).float().cpu()
    sorted_ids, order = torch.sort(flat, stable=True)
    out, n, i = grad.clone().cpu(), flat.numel(), 0
    while i < n:
        j = i
        while j < n and sorted_ids[j] == sorted_ids[i]:
            j += 1
        total = torch.zeros(grad.shape[1])
        for p in range(i, j, NROWS):
            part = torch.zeros(grad.shape[1])
            for r in range(p, min(p + NROWS, j)):
                part = part + rows[order[r]]
            total = total + part
        row = int(sorted_ids[i])
        out[row] = (out[row].float() + total.to(grad.dtype).float()).to(grad.dtype)
        i = j
    return out


def _ids(n: int, vocab: int, seed: int = 0) -> torch.Tensor:
    """n ids over `vocab` with a few ids repeated far past a partial's 10 rows and some seen once."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab // 2, (n,), generator=g)
    ids[: n // 4] = torch.randint(0, 3, (n // 4,), generator=g)  # three ids with hundreds of rows each
    ids[-20:] = torch.arange(vocab - 20, vocab)  # twenty ids once each
    return ids[torch.randperm(n, generator=g)]


def test_segments_mark_each_partial_of_ten_rows_and_each_ids_start():
    ids = torch.tensor([7] * 23 + [2] + [9] * 10 + [4] * 11)
    sorted_ids, order, plen, slen = segments(ids)
    assert sorted_ids.tolist() == [2] + [4] * 11 + [7] * 23 + [9] * 10
    assert order[:2].tolist() == [23, 34] and order[12:35].tolist() == list(range(23))  # stable: equal ids in their order
    want_plen = [1] + [10] + [0] * 9 + [1] + [10] + [0] * 9 + [10] + [0] * 9 + [3, 0, 0] + [10] + [0] * 9
    assert plen.tolist() == want_plen
    assert slen.tolist() == [1] + [11] + [0] * 10 + [23] + [0] * 22 + [10] + [0] * 9


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("dim", [37, 1030])  # within one program's columns, and over two (BLOCK_D 1024)
def test_the_fold_is_torchs_cuda_sum_bit_for_bit(dtype, dim):
    vocab, n = 61, TORCH_SORT_PATH_ABOVE + 29
    ids = _ids(n, vocab).to(DEVICE).view(1, n)
    g = torch.Generator().manual_seed(1)
    gy = torch.randn(1, n, dim, generator=g).to(dtype).to(DEVICE)
    grad = torch.randn(vocab, dim, generator=g).to(dtype).to(DEVICE)
    got = fold_rows_(grad.clone(), ids, gy)
    assert torch.equal(got.cpu(), torch_cuda_sum(grad, ids, gy))
    exact = grad.double() + torch.zeros(vocab, dim, dtype=torch.float64, device=DEVICE).index_add_(0, ids.view(-1), gy.view(n, dim).double())
    # two roundings to the dtype (the sum, then the add); fp32: hundreds of rows summed, a few ulps each
    tol = {torch.bfloat16: 2 ** -5, torch.float16: 2 ** -8, torch.float32: 1e-5}[dtype]
    assert ((got.double() - exact).abs() / exact.abs().clamp(min=1.0)).max() < tol


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view({2: torch.int16, 4: torch.int32}[t.element_size()])


@needs_gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_on_a_gpu_the_fold_is_torchs_own_backward_and_add(dtype):
    """LLaMA 3.2 1B's table and a 4 x 2048-token batch: the head's gradient plus torch's
    embedding_dense_backward, added as autograd adds them, against the fold, every bit but one case:
    torch's add of a zero-filled row turns the head's -0.0 into +0.0, and the fold leaves it."""
    vocab, dim, n = 128256, 2048, 8192
    ids = (torch.randint(0, 16384, (4, 2048), device="cuda") ** 2 % vocab)  # a skewed draw: long and short runs
    gy = torch.randn(4, 2048, dim, device="cuda").to(dtype)
    head = torch.randn(vocab, dim, device="cuda").to(dtype)
    head[:, :8] = -0.0  # rows the batch misses keep these; torch's add makes them +0.0
    want = head + torch.ops.aten.embedding_dense_backward(gy, ids, vocab, -1, False)
    got = fold_rows_(head.clone(), ids, gy)
    differ = _bits(got) != _bits(want)
    touched = torch.zeros(vocab, dtype=torch.bool, device="cuda")
    touched[ids.view(-1)] = True
    assert bool((got[differ] == 0).all() and torch.signbit(got[differ]).all() and not torch.signbit(want[differ]).any())
    # the planted -0.0s, and in fp16 any randn draw under 3e-8 in size that rounded to -0.0 (a few of 262M)
    negative_zero = (head == 0) & torch.signbit(head)
    assert int(differ.sum()) == int(negative_zero[~touched].sum()) >= 8 * int((~touched).sum()) and n > TORCH_SORT_PATH_ABOVE


class _Tied(nn.Module):
    def __init__(self, vocab: int = 64, dim: int = 24):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, dim), nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.embed(x)))


def _grad(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    model.zero_grad(set_to_none=True)
    F.cross_entropy(model(x).flatten(0, 1), y.flatten()).backward()
    return model.embed.weight.grad.clone()


def test_a_tied_model_gets_the_same_gradient_with_the_rows_folded():
    """The swap keeps the Parameter and the state dict; above 3072 tokens the weight's gradient is
    the head's plus the embedding's (torch's CPU kernels sum in another order: fp32's rounding), two
    steps running; at 3072 or fewer it is torch's own, bit for bit; a backward that never reached the
    weight's accumulation (torch.autograd.grad) leaves its rows pending, and the next forward says so.
    A 1000 x 64 table: on a GPU of up to 250 SMs torch sums it in order (torch_sums_atomically), and
    three ids of hundreds of rows each take many partials."""
    torch.manual_seed(0)
    plain = _Tied(1000, 64).to(DEVICE)
    folded = copy.deepcopy(plain)
    assert tie_gradient(folded.embed) and type(folded.embed) is TiedEmbedding and folded.head.weight is folded.embed.weight
    assert folded.state_dict().keys() == plain.state_dict().keys()
    x, y = _ids(3200, 1000).view(4, 800).to(DEVICE), _ids(3200, 1000, seed=1).view(4, 800).to(DEVICE)
    for _ in range(2):
        want, got = _grad(plain, x, y), _grad(folded, x, y)
        if DEVICE == "cuda":  # torch's CUDA sums: the same bits through autograd
            assert torch.equal(_bits(got), _bits(want))
        else:
            assert torch.allclose(got, want, rtol=1e-5, atol=1e-8)
    assert torch.equal(_grad(folded, x[:, :100], y[:, :100]), _grad(plain, x[:, :100], y[:, :100]))
    # autograd.grad accumulates nothing, so no hook adds the rows: they stay pending, and the next forward refuses
    torch.autograd.grad(F.cross_entropy(folded(x).flatten(0, 1), y.flatten()), [folded.embed.weight])
    with pytest.raises(RuntimeError, match="never added"):
        folded(x)
    assert not tie_gradient(nn.Embedding(8, 4, padding_idx=0))  # torch skips that row: not this sum
    double_plain = _Tied(1000, 64).to(DEVICE).double()
    double_folded = copy.deepcopy(double_plain)
    tie_gradient(double_folded.embed)  # fp64: torch sums in fp64, so its own gradient is given
    assert torch.equal(_grad(double_folded, x, y), _grad(double_plain, x, y))


def test_where_torch_sums_with_atomics_the_backward_gives_torchs_own_gradient(monkeypatch):
    """torch's fused atomic kernel (an order that changes run to run) takes a small, narrow table:
    torch_sums_atomically follows its heuristic, and there the embedding's backward hands autograd
    torch's own gradient, leaving nothing for the hook."""
    from perflab_kernels.triton import embedding_grad

    assert torch_sums_atomically(3200, 64, 24, sms=132)  # 64 blocks of a kernel per id, 384 partials: atomics
    assert torch_sums_atomically(3104, 61, 37, sms=132)
    assert not torch_sums_atomically(3200, 1000, 64, sms=132)  # 1000 blocks fill 132 SMs: in order
    assert not torch_sums_atomically(8192, 128256, 2048, sms=132)  # LLaMA 3.2 1B's table and batch
    assert not torch_sums_atomically(3200, 64, 24, sms=8)  # few SMs: a kernel per id fills them
    monkeypatch.setattr(torch, "are_deterministic_algorithms_enabled", lambda: True)
    assert not torch_sums_atomically(3200, 64, 24, sms=132)  # deterministic algorithms: torch sums in order
    monkeypatch.undo()

    if DEVICE == "cpu":  # no SMs here: take the GPU's answer for a 64-token table
        monkeypatch.setattr(embedding_grad, "_sums_atomically", lambda ids, num_weights, gy: True)
    torch.manual_seed(0)
    plain = _Tied().to(DEVICE)
    folded = copy.deepcopy(plain)
    tie_gradient(folded.embed)
    x, y = torch.randint(0, 64, (4, 800), device=DEVICE), torch.randint(0, 64, (4, 800), device=DEVICE)
    got = _grad(folded, x, y)
    assert not folded.embed.weight._tied_embedding_pending  # the rows went to autograd, not the hook
    if DEVICE == "cpu":
        assert torch.equal(got, _grad(plain, x, y))  # torch's own CPU kernel both ways
    else:  # torch's atomics: the same values, rounded in an order of their own each run
        assert torch.allclose(got, _grad(plain, x, y), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("overrides,line", [
    (["model=mini_llm", "speed.tied_embedding_grad=on"], "model=mini_llm does not tie them (model.tie_embeddings=false)"),
    (["model=llama3_8b", "speed.tied_embedding_grad=on"], "model=llama3_8b does not tie them"),
])
def test_an_untied_model_is_refused_in_one_line(overrides, line):
    from src.speed.apply import refusal

    got = refusal(compose_config(overrides))
    assert got is not None and line in got and "\n" not in got
    assert refusal(compose_config(["model=llama3_tiny", "speed.tied_embedding_grad=on"])) is None


def test_where_it_stays_off(monkeypatch):
    from perflab_kernels.triton.device import interpreted
    from src.models import build_model
    from src.speed import tied_embedding
    from src.speed.tied_embedding import why_off
    from src.speed.versions import release, torch_version

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    auto = compose_config(["model=llama3_tiny", "speed.tied_embedding_grad=auto"])
    on = compose_config(["model=llama3_tiny", "speed.tied_embedding_grad=on"])
    model = build_model(auto.model)
    here = release(torch_version())
    monkeypatch.setattr(tied_embedding, "VERIFIED", (here,))
    assert why_off(auto, model, cuda, ddp=False) is None  # a release its GPU tests matched: auto runs
    monkeypatch.setattr(tied_embedding, "VERIFIED", ("2.11",) if here != "2.11" else ("2.13",))
    assert f"not on {torch_version()}" in why_off(auto, model, cuda, ddp=False)  # any other: off, naming this torch
    monkeypatch.setattr(tied_embedding, "VERIFIED", ())
    assert "on no torch yet" in why_off(auto, model, cuda, ddp=False)
    assert why_off(compose_config(["model=llama3_tiny", "speed.tied_embedding_grad=auto", "speed.force_unverified=true"]), model, cuda,
                   ddp=False) is None
    assert why_off(on, model, cuda, ddp=False) is None
    assert "DDP" in why_off(on, model, cuda, ddp=True)
    assert "CUDA" in why_off(auto, model, cpu, ddp=False)  # auto: not on a CPU, interpreter or not
    untied = build_model(compose_config(["model=llama3_tiny", "model.tie_embeddings=false"]).model)
    assert "not the embedding's" in why_off(on, untied, cuda, ddp=False)
    if interpreted():  # a CPU machine's tests run Triton's interpreter (tests/support/devices.py): `on` runs there
        assert why_off(on, model, cpu, ddp=False) is None
    else:  # a GPU machine's compile for CUDA: a CPU run is off, `on` or not
        assert "CUDA" in why_off(on, model, cpu, ddp=False)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CPU run whose kernels run in Triton's interpreter, which a process on a GPU machine does not use")
def test_a_one_rank_fsdp2_run_with_it_trains_as_without(tmp_path, in_process_runs):
    """model=llama3_tiny under FSDP2 on one gloo rank, 2 x 1600 tokens a step (above 3072: the fold
    runs), three steps with it and without: the summary lists it, and the losses and gradient norms
    are the same to fp32's rounding (torch's CPU kernels sum the embedding's rows in another order).
    fp32 parameters: in bf16 torch's CPU kernel sums each id's rows in bf16 (3% off the gradient norm
    at this batch, where the fold and torch's CUDA kernel sum in fp32)."""
    from tests.support.in_process import train_on_and_off

    one = ["model=llama3_tiny", "dist.nproc=1", "train.steps=3", "data.seq_len=1600", "data.batch_size=2", "tracking=none",
           "train.progress=false", "optim.grad_clip=1.0", "precision.param_dtype=float32"]
    runs = train_on_and_off(tmp_path, one, "speed.tied_embedding_grad")
    for use, (summary, _) in runs.items():
        assert ("tied_embedding_grad" in summary["speed_recipes"]) is (use == "on")
    metrics = {use: lines for use, (_, lines) in runs.items()}
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in metrics["on"]] == pytest.approx([m[key] for m in metrics["off"]], rel=1e-5), key
