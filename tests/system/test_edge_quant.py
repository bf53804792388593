"""Weight-only quantization on the edge path (edge.quant, src/edge/quant.py): each format's logits
against torch fp32 on Mesa's lavapipe, the tokens, the archive's sizes, the refusals."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("iree.turbine")

from src.edge.bench import TOLERANCE, agreement, generate, reference_logits, relative_errors, tolerance, torch_greedy  # noqa: E402
from src.edge.compile import module_key  # noqa: E402
from src.edge.quant import QuantLinear, fuse_dequantization, grouped_product, quant_spec, quantize, quantized_copy  # noqa: E402
from src.edge.task import deployed, quant_setting, reference_model  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402
from tests.support.lavapipe import in_own_process, needs_vulkan  # noqa: E402

# batch 1, as the CLI runs by default: its int8 decode is a matrix-vector product with the
# dequantization fused in (src/edge/quant.py), and the CLI test below shares the int8 module
PROMPT, STEPS, BATCH = 8, 32, 1


def _tiny() -> dict:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    return OmegaConf.to_container(compose_config(["model=tiny"]).model, resolve=True)


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("edge_quant_cache")


def test_int8_and_int4_store_what_dequantizes_to_the_rounded_weights():
    torch.manual_seed(0)
    linear = torch.nn.Linear(64, 8)
    int8, int4 = QuantLinear(linear, "int8"), QuantLinear(linear, "int4", 32)
    assert int8.weight_q.dtype == torch.int8 and int8.weight_q.shape == (8, 64) and int8.weight_scale.shape == (8, 1)
    assert int4.weight_q.dtype == torch.int8 and int4.weight_q.shape == (8, 32) and int4.weight_scale.shape == (8, 2, 1)
    w = linear.weight.detach()
    # every weight within half a step of its row's (int8) or group's (int4) scale
    assert ((int8.dequantized(torch.float32) - w).abs() <= int8.weight_scale / 2 + 1e-7).all()
    step = int4.weight_scale.expand(8, 2, 32).reshape(8, 64)
    assert ((int4.dequantized(torch.float32) - w).abs() <= step / 2 + 1e-7).all()
    # the nibbles: column 2j low, 2j + 1 high, two's complement
    codes = torch.round(w.view(8, 2, 32) / int4.weight_scale).view(8, 64).to(torch.int8)
    assert torch.equal((int4.weight_q << 4) >> 4, codes[:, 0::2]) and torch.equal(int4.weight_q >> 4, codes[:, 1::2])
    # the batched path (several rows: a dispatch of its own) computes the same weights as the fused one
    for layer in (int8, int4):
        x = torch.randn(3, 5, 64)
        assert torch.allclose(layer(x), torch.nn.functional.linear(x, layer.dequantized(torch.float32), linear.bias), atol=1e-6)
        assert torch.allclose(layer(x[:1, :1]), layer(x)[:1, :1], atol=1e-6)


def test_the_grouped_product_is_the_linear_of_its_groups():
    """QuantLinear's exported int4 form (grouped_product): F.linear of the (out, in) weight, for one
    row (rows first) and several (weights first), in fp32 and fp16 (accumulated in fp32)."""
    g = torch.Generator().manual_seed(0)
    w = torch.randn(24, 96, generator=g)
    for shape in [(1, 96), (1, 1, 96), (3, 96), (2, 3, 96)]:
        x = torch.randn(*shape, generator=g)
        for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
            got = grouped_product(x.to(dtype), w.to(dtype).view(24, 3, 32))
            want = torch.nn.functional.linear(x.to(dtype).float(), w.to(dtype).float())
            assert got.shape == (*shape[:-1], 24) and got.dtype == dtype
            torch.testing.assert_close(got.float(), want, rtol=tol, atol=tol)


def _int4_on_iree_cpu(tmp_path: Path, cache: Path) -> dict:
    """tiny int4, its dequantization fused (`fuse`, which llvmpipe turns off), compiled for IREE's
    CPU device at batch 2 with edge.matvec_rows=2: decode's products are the grouped i4 ones
    (src/edge/int4.py), prefill's the i4 dequantization then the matmul."""
    from src.edge.compile import build
    from src.edge.matvec import use_matvec
    from src.edge.runtime import IreeRunner

    model, spec, batch = _tiny(), {"format": "int4", "fused": True, "group_size": 32}, 2
    ref = reference_model(model, {"seed": 0}, PROMPT + 10, batch)
    lm = use_matvec(deployed(ref, {"dtype": "fp32", "quant": spec}), batch)
    art = build(lm, model, PROMPT, "fp32", "llvm-cpu", "host", "", tmp_path / "art", cache, {"seed": 0}, functions=("prefill", "decode", "kv_cache"))
    tokens = np.random.default_rng(1).integers(0, 256, (batch, PROMPT)).astype(np.int32)
    gen = generate(IreeRunner(art, "local-task"), tokens, 10, check=True)
    fed = gen.tokens[:-1]
    return {"variant": art.manifest["variant"],
            "rel_err_vs_quantized": max(relative_errors(gen.logits, reference_logits(quantized_copy(ref, spec), tokens, fed))),
            "same_steps": agreement(gen.tokens, torch_greedy(deployed(ref, {"dtype": "fp32", "quant": spec}), tokens, 10))[1]}


def test_int4_read_as_i4_computes_the_quantized_models_logits(tmp_path, cache):
    got = _int4_on_iree_cpu(tmp_path, cache)
    assert got["variant"].endswith("matvec2-int4g32"), got
    assert got["rel_err_vs_quantized"] <= TOLERANCE["fp32"] and got["same_steps"] == 11, got


def test_the_summary_says_where_decode_dequantizes():
    from src.edge.task import dequantization

    def manifest(fmt: str, fused: bool, batch: int, matvec_rows: int = 0, hoisting: str = "no growing hoists") -> dict:
        return {"quant": {"format": fmt, "fused": fused}, "batch": batch, "matvec_rows": matvec_rows, "hoisting": hoisting}

    fused, apart = "per call, fused into the matvecs", "per call, a dispatch of its own"
    assert dequantization(manifest("int4", True, 1)) == dequantization(manifest("int8", True, 4, matvec_rows=4)) == fused
    # a batch past edge.matvec_rows multiplies as a matmul; llvmpipe (fused off) never fuses
    assert dequantization(manifest("int4", True, 4)) == dequantization(manifest("int4", True, 8, matvec_rows=4)) == apart
    assert dequantization(manifest("int8", False, 1)) == apart
    assert dequantization(manifest("int4", True, 1, hoisting="IREE's default")) == "at load"
    assert dequantization({"quant": {"format": "none"}}) is None


def test_the_module_key_and_manifest_change_with_the_format():
    model = _tiny()
    ref = reference_model(model, {"seed": 0}, PROMPT + STEPS, BATCH)
    specs = [quant_spec(quantized_copy(ref, quant_setting(fmt, group))) for fmt, group in (("none", 32), ("int8", 32), ("int4", 32), ("int4", 64))]
    assert specs == [{"format": "none"}, {"format": "int8", "fused": True}, {"format": "int4", "fused": True, "group_size": 32},
                     {"format": "int4", "fused": True, "group_size": 64}]
    unfused = quant_spec(quantized_copy(ref, quant_setting("int8", 32, fused=False)))
    keys = {module_key(model, BATCH, PROMPT, PROMPT + STEPS, "fp32", "vulkan", [], quant=spec) for spec in [*specs, unfused]}
    assert len(keys) == 5 and unfused == {"format": "int8", "fused": False}
    # LLaMA's tied head and its embedding stay as they were; only the blocks' Linears change
    q = quantize(copy.deepcopy(ref), "int8")
    assert q.model.head.weight.dtype == torch.float32 and all(isinstance(b.ffn.up, QuantLinear) for b in q.model.layers)


def _generates(dtype: str, quant: str, tmp_path: Path, cache: Path) -> dict:
    """Compile tiny as (dtype, quant) for llvmpipe, prefill + STEPS greedy decode steps on lavapipe;
    the logits' largest relative error against torch fp32 unquantized and against torch fp32 with
    the same quantized weights, the tokens against torch fp32's own greedy generation, and the steps
    on which they are torch's in the same format (dtype and weights: the model the module runs)."""
    from src.edge.compile import build
    from src.edge.runtime import IreeRunner

    model = _tiny()
    settings = {"dtype": dtype, "quant": quant_setting(quant, 32, fuse_dequantization("vulkan", "llvmpipe"))}
    ref = reference_model(model, {"seed": 0}, PROMPT + STEPS, BATCH)
    art = build(deployed(ref, settings), model, PROMPT, dtype, "vulkan", "llvmpipe", "", tmp_path / "art", cache)
    runner = IreeRunner(art, "vulkan")
    tokens = np.random.default_rng(1).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    gen = generate(runner, tokens, STEPS, check=True)
    fed = gen.tokens[:-1]
    quantized = quantized_copy(ref, settings["quant"])
    share, same_steps = agreement(gen.tokens, torch_greedy(copy.deepcopy(ref), tokens, STEPS))
    same_format = reference_logits(deployed(ref, settings), tokens, fed)  # torch in the module's dtype and weights, fed its tokens
    errors = relative_errors(gen.logits, same_format)
    # a token other than torch's argmax where torch's top logit leads it by more than twice the
    # module's error at that step: a near-tie of random weights parts the two, a wrong module does more
    departures = [(step, b) for step, (got, want, err) in enumerate(zip(gen.tokens, same_format, errors)) for b in range(len(got))
                  if want[b].max() - want[b][got[b]] > 2 * err * np.abs(want[b]).max()]
    return {"format_departures": departures, "rel_err": max(relative_errors(gen.logits, reference_logits(copy.deepcopy(ref), tokens, fed))),
            "rel_err_vs_quantized": max(relative_errors(gen.logits, reference_logits(quantized, tokens, fed))),
            "token_agreement": share, "same_tokens_steps": same_steps, "manifest": art.manifest}


@needs_vulkan
@pytest.mark.parametrize("dtype,quant", [("fp16", "none"), ("fp16", "int8"), ("fp32", "int4")])
def test_each_format_is_within_its_tolerance_of_torch_on_lavapipe(dtype, quant, tmp_path, cache):
    got = in_own_process(_generates, dtype, quant, tmp_path, cache)
    assert got["rel_err"] <= tolerance(dtype, quant), got
    # the device computes what was quantized: against the quantized torch model, the dtype's own tolerance
    assert got["rel_err_vs_quantized"] <= TOLERANCE[dtype], got
    assert got["manifest"]["quant"] == quant_setting(quant, 32, fused=False) and (quant == "none") == ("int" not in got["manifest"]["variant"])
    # torch's greedy tokens in the same format (dtype and weights), fed the module's, at every one of
    # the 32 decode steps, but where torch's top two logits are closer than the module's error
    assert got["format_departures"] == [], got
    if quant != "int4":
        # against fp32 torch unquantized they part where its two best logits are closer than the
        # format's error: at step 14 of this prompt fp32's top two differ by 2.5e-6 of a largest
        # logit of 0.014 (1.7e-4; fp16's error is 1.2e-3), and fp16, torch's on the CPU as the
        # module's, takes the other
        assert got["same_tokens_steps"] >= 14, got


def _archive(irpa: Path) -> dict[str, int]:
    import iree.runtime as rt

    index = rt.ParameterIndex()
    index.load(str(irpa))
    return {key: entry.length for key, entry in index.items() if not entry.is_splat}


@needs_vulkan
def test_int8_run_reports_errors_tokens_and_sizes_and_its_archive_is_a_quarter(tmp_path, cache):
    from src.edge.params import write_params

    proc = run_cli(["+exp=edge", f"edge.cache_dir={cache}", f"edge.prompt_len={PROMPT}", f"edge.decode_steps={STEPS}", "edge.repeats=1",
                    "edge.warmup=0", "edge.quant=int8"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (path,) = tmp_path.glob("outputs/*/*/summary.json")
    summary = json.loads(path.read_text())
    assert summary["quant"] == "int8" and summary["variant"] == "llvmpipe-nocoop-int8" and summary["status"] == "finished"
    assert summary["dequantization"] == "per call, a dispatch of its own"  # llvmpipe: fuse_dequantization
    assert summary["rel_err"] <= TOLERANCE["int8"] and summary["rel_err_vs_quantized"] <= TOLERANCE["fp32"]
    # against fp32 torch's own generation (this prompt parts from it where fp32's two best logits nearly tie)
    assert 0 < summary["token_agreement"] <= 1 and 1 <= summary["same_tokens_steps"] <= STEPS + 1 and len(summary["generated"][0]) == STEPS + 1
    assert summary["module_bytes"] > 0 and summary["params_bytes"] == path.parent.joinpath("artifacts", "params.irpa").stat().st_size
    from mlflow.tracking import MlflowClient  # here, not at the top: the spawned processes import this module

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    metrics = run.data.metrics
    assert run.data.params["edge.quant"] == "int8" and metrics["summary.rel_err"] == pytest.approx(summary["rel_err"])
    assert {"summary.token_agreement", "summary.same_tokens_steps", "summary.module_bytes", "summary.params_bytes", "summary.block_weight_bytes"} <= set(metrics)
    # the archive: each block weight an int8 matrix and a row of fp32 scales, against the fp32 matrix
    # (tiny's in-features 64 and 256: 4 / (1 + 4 / in) = 3.76 to 3.94 times smaller)
    quantized = _archive(path.parent / "artifacts" / "params.irpa")
    write_params(reference_model(_tiny(), {"seed": 0}, PROMPT + STEPS, BATCH), tmp_path / "fp32.irpa")
    full = _archive(tmp_path / "fp32.irpa")
    weights = [k for k in full if ".layers." in k and k.endswith(".weight") and "norm" not in k]
    stored = sum(quantized[k.removesuffix("weight") + part] for k in weights for part in ("weight_q", "weight_scale"))
    assert 3.7 < sum(full[k] for k in weights) / stored < 4.0
    assert {k: v for k, v in quantized.items() if "weight_" not in k} == {k: v for k, v in full.items() if k not in weights}  # the rest as it was
    assert summary["block_weight_bytes"] == stored


@pytest.mark.parametrize("args,line", [
    # IREE's adreno target has no 8-bit storage buffers: the int8 weights do not compile for it
    (["edge.target=adreno", "edge.quant=int8", "edge.action=compile", "edge.artifacts=art"],
     "error: edge.quant=int8: Vulkan target adreno has no 8-bit storage buffers to read the int8 weights from"),
    (["edge.quant=int4", "edge.quant_group=128"], "error: edge.quant_group=128 does not divide the in-features [64] of the model's Linears; edge.quant_group=64 does"),
    (["edge.quant=int3"], "error: edge.quant=int3: not a choice of edge.quant; use one of: none, int8, int4"),
])
def test_a_format_that_cannot_run_is_refused_in_one_line_before_anything_starts(args, line, tmp_path):
    proc = run_cli(["+exp=edge", *args], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "art").exists() and not (tmp_path / "mlflow.db").exists()
