"""Fused Triton RMSNorm against torch's, forward and backward, on odd shapes (interpreter on CPU)."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

triton = pytest.importorskip("triton")

from perflab_kernels.triton.rms_norm import FusedRMSNorm, fused_add_rms_norm, fused_rms_norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# (atol, rtol) per dtype. fp32: the kernel and torch sum in a different order; bf16: outputs are
# rounded to 8 mantissa bits either way (Liger-Kernel's bf16 bounds for the same op).
TOLERANCE = {torch.float32: (1e-5, 1e-5), torch.bfloat16: (2e-2, 2e-2)}
SHAPES = [(5, 123), (3, 7, 257), (1, 1024), (17, 64)]


def _reference(x, w, eps):
    return torch.nn.functional.rms_norm(x.float(), (x.shape[-1],), w.float(), eps).to(x.dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_forward_and_backward_match_torch(shape, dtype):
    torch.manual_seed(0)
    atol, rtol = TOLERANCE[dtype]
    n = shape[-1]
    x = torch.randn(shape, device=DEVICE, dtype=dtype) * 3 + 0.5
    w = (torch.randn(n, device=DEVICE) * 0.5 + 1).to(dtype)
    dy = torch.randn(shape, device=DEVICE, dtype=dtype)

    x1, w1 = x.clone().requires_grad_(), w.clone().requires_grad_()
    y = fused_rms_norm(x1, w1, 1e-6)
    y.backward(dy)
    x2, w2 = x.clone().requires_grad_(), w.clone().requires_grad_()
    ref = _reference(x2, w2, 1e-6)
    ref.backward(dy)

    torch.testing.assert_close(y, ref, atol=atol, rtol=rtol)
    torch.testing.assert_close(x1.grad, x2.grad, atol=atol, rtol=rtol)
    # dw sums over every row: its error grows with the row count, hence the wider bound in bf16
    torch.testing.assert_close(w1.grad.float(), w2.grad.float(), atol=atol * 10, rtol=rtol * 5)


@pytest.mark.parametrize("rows", [(4, 2, 0), (2, 4, 0), (1, 1, 1), (2, 1, 1)], ids=["fwd4-bwd2", "fwd2-bwd4", "fwd-looped", "fwd2-looped"])
@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 257)], ids=lambda s: "x".join(map(str, s)))
def test_multi_row_tiles_match_torch(shape, rows, monkeypatch):
    """Several rows per tile (FWD_ROWS, BWD_ROWS): row counts that do not divide into tiles, and
    backward programs whose rows end inside a tile, give torch's results, with and without the add;
    so does a forward whose programs loop over several tiles (FWD_PROGRAMS_PER_SM > 0)."""
    import perflab_kernels.triton.device as device
    import perflab_kernels.triton.rms_norm as rn

    monkeypatch.setattr(device, "INTERPRETER_ROWS", 1)  # the tiles asked for, in the interpreter too
    monkeypatch.setattr(rn, "FWD_ROWS", rows[0])
    monkeypatch.setattr(rn, "BWD_ROWS", rows[1])
    monkeypatch.setattr(rn, "FWD_PROGRAMS_PER_SM", rows[2])  # 2 programs on a CPU: 3-21 tiles each walk
    monkeypatch.setattr(rn, "FWD_STAGES", 2)
    monkeypatch.setattr(rn, "BWD_PROGRAMS_PER_SM", 1)  # 2 programs on a CPU: 5 rows end mid-tile
    torch.manual_seed(2)
    atol, rtol = TOLERANCE[torch.float32]
    n = shape[-1]
    x, r, dy, ds = (torch.randn(shape, device=DEVICE) for _ in range(4))
    w = torch.rand(n, device=DEVICE) + 0.5
    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    s, y = fused_add_rms_norm(*leaves, 1e-6)
    torch.autograd.backward([s, y], [ds, dy])
    y1 = fused_rms_norm(leaves[0], leaves[2], 1e-6)
    ref_leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    ref_s = ref_leaves[0] + ref_leaves[1]
    ref_y = _reference(ref_s, ref_leaves[2], 1e-6)
    torch.autograd.backward([ref_s, ref_y], [ds, dy])
    torch.testing.assert_close(s, ref_s, atol=atol, rtol=rtol)
    torch.testing.assert_close(y, ref_y, atol=atol, rtol=rtol)
    torch.testing.assert_close(y1, _reference(x, w, 1e-6), atol=atol, rtol=rtol)
    for got, want in zip(leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=atol * 10, rtol=rtol * 5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("shape", [(5, 123), (3, 7, 257)], ids=lambda s: "x".join(map(str, s)))
def test_residual_add_and_norm_match_torch(shape, dtype):
    """(x + r, rmsnorm(x + r)): both outputs used downstream, as in the pre-norm block."""
    torch.manual_seed(1)
    atol, rtol = TOLERANCE[dtype]
    n = shape[-1]
    x, r = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(2))
    w = (torch.rand(n, device=DEVICE) + 0.5).to(dtype)
    ds, dy = (torch.randn(shape, device=DEVICE, dtype=dtype) for _ in range(2))

    leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    s, y = fused_add_rms_norm(*leaves, 1e-6)
    torch.autograd.backward([s, y], [ds, dy])
    ref_leaves = [t.clone().requires_grad_() for t in (x, r, w)]
    ref_s = ref_leaves[0] + ref_leaves[1]
    ref_y = _reference(ref_s, ref_leaves[2], 1e-6)
    torch.autograd.backward([ref_s, ref_y], [ds, dy])

    # The sum is rounded to the input dtype, as eager's is; Triton's interpreter may round a bf16
    # differently from the GPU's round-to-nearest, so one bf16 ulp (2^-7 relative) is allowed.
    torch.testing.assert_close(s, ref_s, atol=0, rtol=0 if dtype == torch.float32 else 2**-7)
    torch.testing.assert_close(y, ref_y, atol=atol, rtol=rtol)
    for name, got, want in zip("xrw", leaves, ref_leaves):
        scale = 10 if name == "w" else 1
        torch.testing.assert_close(got.grad.float(), want.grad.float(), atol=atol * scale, rtol=rtol * scale, msg=f"d{name}")


@pytest.mark.parametrize("layout", ["column-slice", "transposed", "permuted-3d"])
def test_strided_inputs_match_torch(layout):
    """Inputs a kernel reads in place with their own row stride (a column slice of a wider tensor),
    and inputs it must copy first (transposed; a 3-D tensor with its first two dims swapped), for x,
    the residual and the incoming gradients alike: contiguous tensors are handed over as they are
    (kernels/triton/rows.py), the others keep their strides or are made contiguous."""
    torch.manual_seed(3)
    atol, rtol = TOLERANCE[torch.float32]
    rows, n = 6, 37

    def strided(t: torch.Tensor) -> torch.Tensor:
        if layout == "column-slice":
            wide = torch.randn(rows, n + 5, device=DEVICE)
            wide[:, :n] = t
            return wide[:, :n]
        if layout == "transposed":
            return t.t().contiguous().t()
        return t.reshape(2, 3, n).transpose(0, 1).contiguous().transpose(0, 1)

    base = [torch.randn(rows, n, device=DEVICE) for _ in range(4)]
    x, r, dy, ds = (strided(t) for t in base)
    assert not any(t.is_contiguous() for t in (x, r, dy, ds))
    w = torch.rand(n, device=DEVICE) + 0.5
    # clone keeps a dense tensor's strides; a column slice is not dense, so it is detached instead
    leaves = [t.clone().requires_grad_() if layout != "column-slice" else t.detach().requires_grad_() for t in (x, r, w)]
    assert not leaves[0].is_contiguous() and not leaves[1].is_contiguous()
    s, y = fused_add_rms_norm(*leaves, 1e-6)
    torch.autograd.backward([s, y], [ds, dy])
    y1 = fused_rms_norm(x, w, 1e-6)
    ref_leaves = [t.detach().clone().requires_grad_() for t in (x, r, w)]
    ref_s = ref_leaves[0] + ref_leaves[1]
    ref_y = _reference(ref_s, ref_leaves[2], 1e-6)
    torch.autograd.backward([ref_s, ref_y], [ds, dy])
    torch.testing.assert_close(y1, _reference(x, w, 1e-6), atol=atol, rtol=rtol)
    torch.testing.assert_close(s, ref_s, atol=atol, rtol=rtol)
    torch.testing.assert_close(y, ref_y, atol=atol, rtol=rtol)
    for name, got, want in zip("xrw", leaves, ref_leaves):
        torch.testing.assert_close(got.grad, want.grad, atol=atol * 10, rtol=rtol * 5, msg=f"d{name}")


def test_module_is_a_drop_in_for_nn_rmsnorm():
    norm = torch.nn.RMSNorm(96, eps=1e-6, device=DEVICE)
    with torch.no_grad():
        norm.weight.uniform_(0.5, 1.5)
    fused = FusedRMSNorm.from_module(norm)
    assert fused.weight is norm.weight and list(dict(fused.named_parameters())) == ["weight"]
    x = torch.randn(4, 9, 96, device=DEVICE)
    torch.testing.assert_close(fused(x), norm(x), atol=1e-5, rtol=1e-5)


def test_too_wide_rows_are_refused():
    with pytest.raises(ValueError, match="rows of 70000 > 65536"):
        fused_rms_norm(torch.randn(2, 70000, device=DEVICE), torch.ones(70000, device=DEVICE))


def test_fused_norms_trace_into_one_graph_with_their_kernels():
    """What kernels=compile with kernels.fused=[rms_norm] asks of Dynamo: a block's fused norms
    traced with fullgraph=True (a graph break fails), forward and backward each down to their
    Triton launches (tests/support/trace_fused_norms.py, traced only). In a process of its own: Dynamo
    takes a Triton kernel into a graph only when it is compiled, not under this process's
    interpreter. tests/integration/test_gpu.py runs the compiled block on the GPU, with torch's own version
    there: torch 2.11's Dynamo broke the graph at id() of a warps table in the launch key, which
    this torch traces, so that break showed only on the GPU."""
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, "-m", "tests.support.trace_fused_norms"], cwd=Path(__file__).parents[2], env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and proc.stdout.strip(), proc.stdout[-3000:] + proc.stderr[-3000:]
    launches = json.loads(proc.stdout.strip().splitlines()[-1])
    # forward: one launch; backward: dx and the dw partials, then dw
    assert launches == {"fwd_body_0": 1, "fwd_body_1": 1, "bwd_body_0": 2, "bwd_body_1": 2}, launches


def _losses(cwd):
    import json

    (metrics,) = list(cwd.glob("outputs/*/*/metrics.jsonl"))
    return [json.loads(line)["loss"] for line in metrics.read_text().splitlines()]


def test_tiny_model_with_kernels_triton_trains_like_eager(tmp_path, monkeypatch):
    """Every fused variant at once (RMSNorm with the residual add, SwiGLU, linear + cross-entropy
    with label smoothing) under FSDP2 on 2 ranks: the kernels run on the gathered weights."""
    from src.fusion.registry import interpreter_fault
    from tests.support.cli import run_cli

    fault = interpreter_fault()
    if fault:  # refused by the run's checks (test_a_broken_interpreter_is_refused_before_the_run)
        pytest.skip(fault)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # the CPU ranks run the kernels in Triton's interpreter, GPU or not
    common = ["precision=fp32", "model.mlp=swiglu", "train.label_smoothing=0.1", "train.steps=5", "data.batch_size=2", "data.seq_len=16", "tracking=none"]
    runs = {}
    for kernels in ("eager", "triton"):
        cwd = tmp_path / kernels
        cwd.mkdir()
        proc = run_cli([*common, f"kernels={kernels}"], cwd=cwd)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        runs[kernels] = _losses(cwd)
    assert "fused Triton kernels: rms_norm x4, swiglu x2, softmax x0, linear_cross_entropy x1" in proc.stdout + proc.stderr
    torch.testing.assert_close(torch.tensor(runs["triton"]), torch.tensor(runs["eager"]), rtol=1e-5, atol=1e-5)


def test_kernels_triton_without_gpu_or_interpreter_is_refused(tmp_path, monkeypatch):
    from src.config.compose import ConfigError, compose_config
    from src.config.validate import validate

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="kernels=triton: Triton kernels need an NVIDIA GPU"):
        validate(compose_config(["kernels=triton"]), cuda_device_count=0, mps_available=False)
    # a fused list from an experiment, under kernels=eager: the fix names the list, not kernels=eager
    with pytest.raises(ConfigError, match=r"kernels.fused=\[cross_entropy\] \(kernels=eager\): Triton .* or set kernels.fused=\[\]$"):
        validate(compose_config(["+exp=fsdp4_tuned", "kernels=eager", "backend=cpu"]), cuda_device_count=0, mps_available=False)
    # auto's picks come from a diagnosis, not from kernels.fused: the fix is kernels=eager
    fixture = Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json"
    with pytest.raises(ConfigError, match=r"^kernels=auto: Triton kernels need an NVIDIA GPU .* or use kernels=eager$"):
        validate(compose_config(["kernels=auto", "model=mini_llm", f"kernels.diagnosis={fixture}"]), cuda_device_count=0, mps_available=False)
    # a misspelt op is named before anything about the machine: the same line with or without a
    # usable Triton (a GPU image whose interpreter is refused gave the interpreter's line instead)
    for interpret in ("1", None):
        if interpret:
            monkeypatch.setenv("TRITON_INTERPRET", interpret)
        else:
            monkeypatch.delenv("TRITON_INTERPRET", raising=False)
        with pytest.raises(ConfigError, match=r"kernels.fused=\['layer_norm'\]: no fused Triton variant"):
            validate(compose_config(["kernels=triton", "kernels.fused=[layer_norm]"]), cuda_device_count=0, mps_available=False)


def test_a_broken_interpreter_is_refused_before_the_run(monkeypatch):
    """triton before 3.7 with numpy 2.4+: the interpreter fails mid-run in every kernel that loops
    over program ids (seen with triton 3.6.0 and numpy 2.5.2 on a GPU machine's image), so a CPU run
    that would use it is refused by the config checks in one line naming both versions and the fix."""
    import numpy
    import triton

    from src.fusion.registry import interpreter_fault

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.setattr(triton, "__version__", "3.6.0")
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    assert "triton 3.6.0 fails with numpy 2.4.6" in interpreter_fault()
    from src.config.compose import ConfigError, compose_config
    from src.config.validate import validate

    fix = r"pip install 'numpy<2\.4' \(or a torch whose triton is 3\.7 or later\)"
    with pytest.raises(ConfigError, match=rf"^kernels=triton: Triton's interpreter in triton 3\.6\.0 fails with numpy 2\.4\.6 .*{fix}; or use kernels=eager$"):
        validate(compose_config(["kernels=triton"]), cuda_device_count=0, mps_available=False)
    with pytest.raises(ConfigError, match=rf"^optim.impl=triton: Triton's interpreter .*{fix}; or use optim.impl=foreach$"):
        validate(compose_config(["optim.impl=triton"]), cuda_device_count=0, mps_available=False)
    with pytest.raises(ConfigError, match=rf"^kernel_bench.providers has triton: Triton's interpreter .*{fix}; or drop it from kernel_bench.providers$"):
        validate(compose_config(["+exp=kernels_cpu"]), cuda_device_count=0, mps_available=False)
    # the interpreter runs the kernels whatever the device, so a GPU run under TRITON_INTERPRET=1 is refused too
    with pytest.raises(ConfigError, match=rf"^kernels=triton: Triton's interpreter .*{fix}; or use kernels=eager$"):
        validate(compose_config(["kernels=triton", "backend=cuda", "dist.nproc=1"]), cuda_device_count=1, mps_available=False)
    monkeypatch.setattr(numpy, "__version__", "2.3.5")
    assert interpreter_fault() is None
    monkeypatch.setattr(numpy, "__version__", "2.4.6")
    monkeypatch.setattr(triton, "__version__", "3.7.0")
    assert interpreter_fault() is None


def test_pipeline_stages_fit_shared_memory(monkeypatch):
    """A row loop gets the stages asked for while its buffered loads fit a block's shared memory,
    fewer for wide rows, and 1 (the loop as written) when one stage alone would not fit: on an
    H200 (227 KB) the RMSNorm backward with the residual at 16384 bf16 columns (96 KB a stage) takes
    3, at 65536 fp32 (768 KB) 1."""
    from perflab_kernels.triton import device

    monkeypatch.setattr(device, "smem_per_block", lambda index: 232448)
    assert device.pipeline_stages(4, 3 * 2048 * 2, 0) == 4
    assert device.pipeline_stages(4, 3 * 16384 * 2, 0) == 3
    assert device.pipeline_stages(4, 3 * 65536 * 4, 0) == 1
    assert device.pipeline_stages(1, 8, 0) == 1
