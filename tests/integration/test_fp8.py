"""precision=fp8: composes, is refused in one line where it cannot run, and its plumbing (torchao's
Float8Linear on the block linears, FSDP2's float8 all-gather, the scale precompute) trains on a CPU
rank with emulated float8 GEMMs; on a GPU it trains for real (skipped without one)."""
from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from src.config import Fp8Recipe
from src.config.compose import ConfigError, compose_config
from src.config.validate import validate
from tests.support.cli import run_cli
from tests.support.devices import needs_capability

H200 = ((9, 0), "NVIDIA H200")


def test_fp8_composes_with_bf16_params_and_fp32_reduction():
    p = compose_config(["precision=fp8"]).precision
    # the default casts are the measured ones: Triton's, rowwise with a float8 grad-weight GEMM; torchao's stay a setting
    assert (p.name, p.float8, p.fp8_impl, p.fp8_recipe, p.fp8_all_gather) == ("fp8", True, "triton", "rowwise_with_gw_tensorwise", True)
    assert (p.param_dtype, p.reduce_dtype) == ("bfloat16", "float32")
    assert compose_config(["precision=fp8", "precision.fp8_recipe=rowwise"]).precision.fp8_recipe == "rowwise"
    with pytest.raises(ConfigError, match="precision.fp8_recipe=blockwise"):
        compose_config(["precision=fp8", "precision.fp8_recipe=blockwise"])


@pytest.mark.parametrize("overrides,capability,message", [
    (["backend=cpu"], None, "precision=fp8 runs float8 GEMMs on an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell), not on backend=cpu; use precision=bf16"),
    (["backend=cuda"], ((8, 0), "NVIDIA A100-SXM4-80GB"), "precision=fp8 needs compute capability 8.9+ for float8 tensor cores; NVIDIA A100-SXM4-80GB is 8.0: use precision=bf16"),
    (["backend=cuda", "model.dim=72", "model.n_heads=4"], H200, "precision=fp8: model.dim is 72, not a multiple of 16"),
    (["backend=cuda", "model.ffn_hidden=1000"], H200, "precision=fp8: the MLP's hidden width (model.ffn_hidden) is 1000, not a multiple of 16"),
    (["backend=cuda", "data.batch_size=3", "data.seq_len=100"], H200, "precision=fp8: data.batch_size x data.seq_len is 300, not a multiple of 16"),
])
def test_fp8_is_refused_where_it_cannot_run(overrides, capability, message):
    cfg = compose_config(["precision=fp8", "dist.nproc=1", "tracking=none", *overrides])
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_device_count=1 if capability else 0, mps_available=False, cuda_capability=capability)
    assert str(err.value).startswith(message) and "\n" not in str(err.value)


def test_fp8_impl_triton_takes_its_one_recipe_and_needs_no_torchao(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    base = ["precision=fp8", "precision.fp8_impl=triton", "backend=cuda", "dist.nproc=1", "tracking=none"]
    validate(compose_config(base[:1] + base[2:]), cuda_device_count=1, mps_available=False, cuda_capability=H200)  # the default: triton
    with pytest.raises(ConfigError) as err:
        validate(compose_config([*base, "precision.fp8_recipe=tensorwise"]), cuda_device_count=1, mps_available=False, cuda_capability=H200)
    assert str(err.value) == ("precision.fp8_impl=triton casts for rowwise_with_gw_hp or rowwise_with_gw_tensorwise, not precision.fp8_recipe=tensorwise; "
                              "set one of those or precision.fp8_impl=torchao")
    for recipe in ("rowwise_with_gw_hp", "rowwise_with_gw_tensorwise"):
        validate(compose_config([*base, f"precision.fp8_recipe={recipe}"]), cuda_device_count=1, mps_available=False, cuda_capability=H200)
    torchao = ["precision=fp8", "precision.fp8_impl=torchao", "backend=cuda", "dist.nproc=1", "tracking=none"]
    with pytest.raises(ConfigError, match=r"^precision.fp8_recipe=rowwise_with_gw_tensorwise is cast by precision.fp8_impl=triton only"):
        validate(compose_config(torchao), cuda_device_count=1, mps_available=False, cuda_capability=H200)
    with pytest.raises(ConfigError, match="precision.fp8_impl=gemlite"):
        compose_config([*base, "precision.fp8_impl=gemlite"])


def test_fp8_without_torchao_names_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torchao" else real(name, *a))
    cfg = compose_config(["precision=fp8", "precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise", "backend=cuda", "dist.nproc=1", "tracking=none"])
    with pytest.raises(ConfigError, match=r"torchao's float8, which is not installed: pip install torchao==0\.17\.0"):
        validate(cfg, cuda_device_count=1, mps_available=False, cuda_capability=H200)
    validate(compose_config(["backend=cuda", "dist.nproc=1", "tracking=none"]), cuda_device_count=1, mps_available=False)  # bf16 needs none


def test_fp8_on_a_cpu_is_refused_before_anything_runs(tmp_path: Path):
    proc = run_cli(["precision=fp8"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "precision=fp8 runs float8 GEMMs on an NVIDIA GPU" in proc.stderr
    assert len([line for line in proc.stderr.splitlines() if line.strip()]) == 1
    assert list(tmp_path.iterdir()) == []  # no run directory, no MLflow store


def _train_tiny(float8: bool, steps: int = 4, impl: str = "torchao", recipe: str = "rowwise_with_gw_hp", fold: bool = False,
                tokens_shape: tuple[int, int] = (2, 33)) -> list[float]:
    """The worker's order on one gloo rank: meta model, float8 swap, fully_shard (bf16 params,
    fp32 reduce), seeded init, AdamW, and after each update the float8 scale precompute (torchao's
    float8 all-gather; impl=triton keeps plain bf16 weights and real float8 GEMMs; `fold`: the MLPs'
    SiLU inside the down projections' casts)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor

    from src.distributed.float8 import convert_blocks_to_float8, scale_precompute
    from src.distributed.parallelize import apply_fsdp, materialize_and_init, mixed_precision_policy
    from src.models.mini_llm.model import MiniLLM

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        with torch.device("meta"):
            model = MiniLLM(vocab_size=256, dim=64, n_layers=2, n_heads=4)
        after = None
        if float8 and impl == "triton":
            from perflab_kernels.triton.fp8_linear import Float8RowwiseLinear

            assert convert_blocks_to_float8(model, recipe, fsdp_float8_all_gather=False, impl="triton", fold_activation=fold) == 8
            assert type(model.head) is torch.nn.Linear and type(model.layers[1].ffn.down) is Float8RowwiseLinear
            assert [(type(b.ffn.act), b.ffn.down.act) for b in model.layers] == [(torch.nn.Identity, "silu") if fold else (torch.nn.SiLU, None)] * 2
            assert model.layers[1].ffn.down.float8_grad_weight is (recipe == "rowwise_with_gw_tensorwise")
        elif float8:
            assert convert_blocks_to_float8(model, "tensorwise", fsdp_float8_all_gather=True, emulate=True) == 8  # 4 linears x 2 blocks
            assert type(model.head) is torch.nn.Linear and isinstance(model.layers[1].attn.in_proj, Float8Linear)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), mixed_precision_policy("bfloat16", "float32"))
        materialize_and_init(model, torch.device("cpu"), seed=0)
        if float8 and impl == "torchao":
            weight = model.layers[0].ffn.up.weight
            assert isinstance(weight, DTensor) and isinstance(weight.to_local(), WeightWithDynamicFloat8CastTensor)
            assert 0.015 < weight.to_local().float().std().item() < 0.025  # the seeded N(0, 0.02) reached the subclass
            after = scale_precompute(model)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
        gen = torch.Generator().manual_seed(0)
        tokens = torch.randint(0, 256, tokens_shape, generator=gen)
        losses = []
        for _ in range(steps):
            opt.zero_grad()
            logits = model(tokens[:, :-1]).float()
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 256), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            if after is not None:
                after()
            losses.append(loss.item())
        if float8 and impl == "torchao":
            assert model.layers[0].ffn.up.weight._local_tensor._precomputed_scale is not None  # set by the precompute
        return losses
    finally:
        dist.destroy_process_group()


def test_float8_plumbing_trains_on_a_cpu_rank_with_emulated_gemms():
    """Float8 casts and scales are real here; only the GEMM is emulated (high precision after the
    casts), so the loss follows bf16's: within 0.02 over 4 steps from ln 256 = 5.55."""
    pytest.importorskip("torchao.float8")
    bf16 = _train_tiny(float8=False)
    fp8 = _train_tiny(float8=True)
    assert fp8[-1] < fp8[0] and fp8 == pytest.approx(bf16, abs=0.02)


@pytest.mark.skipif(torch.cuda.is_available(), reason="Triton's interpreter on a CPU rank, which a process on a GPU machine does not use")
@pytest.mark.parametrize("recipe,fold", [("rowwise_with_gw_hp", True), ("rowwise_with_gw_tensorwise", True), ("rowwise_with_gw_tensorwise", False)],
                         ids=["gw_hp", "gw_tensorwise", "gw_tensorwise-silu-apart"])
def test_triton_float8_linears_train_on_a_cpu_rank_with_real_float8_gemms(recipe, fold):
    """precision.fp8_impl=triton: the casts run in Triton's interpreter and the GEMMs are real
    float8 (torch._scaled_mm runs on a CPU too), under FSDP2 on one gloo rank: the loss falls and
    follows bf16's within 0.05 over 3 steps, with the MLPs' SiLU apart or inside the casts. One
    sequence of 16 tokens: the interpreter runs a program per row cast (80-98 s a case at 2 x 32
    tokens and 4 steps, 35-40 s so)."""
    bf16 = _train_tiny(float8=False, steps=3, tokens_shape=(1, 17))
    fp8 = _train_tiny(float8=True, steps=3, impl="triton", recipe=recipe, fold=fold, tokens_shape=(1, 17))
    assert fp8[-1] < fp8[0] and fp8 == pytest.approx(bf16, abs=0.05)
    assert fp8 != bf16  # the GEMMs did run in float8


def _train(cwd: Path, args: list[str], env: dict[str, str] | None = None) -> tuple[str, Path, list[float]]:
    """`python -m src.run args` in a new folder `cwd`, which must succeed: its stdout, run directory
    and the loss of every step metrics.jsonl holds."""
    cwd.mkdir()
    proc = run_cli(args, cwd=cwd, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run_dir = next(cwd.glob("outputs/*/*"))
    return proc.stdout, run_dir, [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.gpu
@needs_capability(8, 9, "needs a GPU of compute capability 8.9+")
@pytest.mark.parametrize("impl", ["torchao", "triton", "triton_gw_tensorwise", "triton_swiglu", "triton_head"])
def test_fp8_trains_on_the_gpu_like_bf16(impl: str, tmp_path: Path):
    """model=small on data=text, 12 steps under FSDP2 with compiled blocks (torchao: tensorwise,
    float8 all-gather; triton: rowwise_with_gw_hp, its Triton casts traced into the compiled
    blocks; triton_swiglu: a SwiGLU MLP folded into kernels/triton/fp8_swiglu.py's one function;
    triton_head: the fused head's logits GEMM in float8 too, precision.fp8_head):
    the loss falls and stays within 0.1 of bf16's at every step (same seed, same batches)."""
    n = min(torch.cuda.device_count(), 2)
    triton = ["precision=fp8", "precision.fp8_impl=triton"]
    gw_tensorwise = [*triton, "precision.fp8_recipe=rowwise_with_gw_tensorwise"]
    fp8 = {"torchao": ["precision=fp8", "precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise"], "triton": [*triton, "precision.fp8_recipe=rowwise_with_gw_hp"], "triton_gw_tensorwise": gw_tensorwise,
           "triton_swiglu": gw_tensorwise, "triton_head": [*gw_tensorwise, "precision.fp8_head=true", "kernels.fused=[linear_cross_entropy]"]}[impl]
    model = ["model=small"] + (["model.mlp=swiglu"] if impl == "triton_swiglu" else [])
    losses = {}
    for precision, overrides in (("bf16", ["precision=bf16"]), ("fp8", fp8)):
        stdout, _, losses[precision] = _train(tmp_path / precision, ["backend=cuda", *model, "data=text", f"dist.nproc={n}", "data.seq_len=512",
                                                                     "train.steps=12", *overrides, "kernels=compile", "tracking=none"])
        if precision == "fp8":
            expected = {"torchao": "float8 (tensorwise scales, torchao casts): 16 block linears, weights all-gathered in float8",
                        "triton": "float8 (rowwise_with_gw_hp scales, triton casts): 16 block linears, weights all-gathered in bf16",
                        "triton_gw_tensorwise": "float8 (rowwise_with_gw_tensorwise scales, triton casts): 16 block linears, weights all-gathered in bf16",
                        "triton_swiglu": "float8 (rowwise_with_gw_tensorwise scales, triton casts): 20 block linears, weights all-gathered in bf16, "
                                         "each SwiGLU MLP one float8 function (fp8_swiglu)",
                        "triton_head": "float8 (rowwise_with_gw_tensorwise scales, triton casts): 16 block linears and the head's logits GEMM, "
                                       "weights all-gathered in bf16"}[impl]
            assert expected in stdout
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.5
    assert losses["fp8"] == pytest.approx(losses["bf16"], abs=0.1)


@pytest.mark.gpu
@needs_capability(8, 9, "needs a GPU of compute capability 8.9+")
@pytest.mark.parametrize("precision,unshard", [("bf16", "on"), ("fp8", "on"), ("fp8", "off")])
def test_blocks_replayed_from_cuda_graphs_train_as_launched_ones(tmp_path: Path, precision: str, unshard: str):
    """speed.cudagraphs=true: the compiled blocks' forward and backward replayed from CUDA graphs
    give the losses of the same run with every kernel launched, over 8 steps of model=small (the
    first step warms the trees up, the second records the graphs, the rest replay them), with
    TritonAdamW writing the unsharded parameters the graphs read in place (speed.cast_in_step, one
    rank) and no graph left to run launched. unshard=off: FSDP2's own unshard, which frees and
    gathers the weights as with two or more ranks, kept in place by speed.keep_unsharded. The
    tolerance is for cuDNN attention's backward: a graph replayed over a tensor still in use would
    move the loss by far more."""
    base = ["backend=cuda", "model=small", "data=text", "dist.nproc=1", "data.seq_len=512", "train.steps=8", "train.log_every=1",
            "tracking=none", "kernels=compile", "optim.impl=triton", "precision.reduce_dtype=bfloat16", "speed.keep_unsharded=true",
            f"speed.one_rank_copies={unshard}"]
    if precision == "fp8":
        base += ["precision=fp8", "precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise"]
    _, graphs_dir, graphs = _train(tmp_path / "graphs", [*base, "speed.cudagraphs=true"])
    _, _, launched = _train(tmp_path / "launched", base)
    assert len(graphs) == 8 and graphs == pytest.approx(launched, abs=1e-3)
    assert graphs[-1] < graphs[0]
    summary = json.loads((graphs_dir / "summary.json").read_text())
    # graphs held (a block's forward and backward at each place in the step), none recorded twice
    # (the weights gathered into the same memory every step) and none run launched
    assert summary["cudagraphs"] >= 2 * compose_config(["model=small"]).model.n_layers
    assert summary["cudagraph_rerecords"] == 0 and summary["cudagraph_skips"] == 0


@pytest.mark.parametrize("recipe", [r for r in Fp8Recipe if r != "rowwise_with_gw_tensorwise"])
def test_each_recipe_of_the_config_converts_the_block_linears(recipe):
    """The recipe arrives as the config's StrEnum member; torchao matched `type(name) == str` and
    refused rowwise as an unknown recipe on the H200 (2026-11-30)."""
    from src.distributed.float8 import convert_blocks_to_float8
    from src.models.mini_llm.model import MiniLLM

    model = MiniLLM(vocab_size=256, dim=64, n_layers=2, n_heads=4)
    assert convert_blocks_to_float8(model, recipe, fsdp_float8_all_gather=False, emulate=True) == 8


@pytest.mark.parametrize("recipe", ["tensorwise", "rowwise"])
def test_fast_accumulation_sets_torchaos_backward_gemms(recipe):
    """precision.fp8_fast_accum with fp8_impl=torchao: every Float8Linear's grad-input and grad-weight
    GEMM configs accumulate fast, the output GEMM's as the recipe has it (fast in both)."""
    from torchao.float8.float8_linear import Float8Linear

    from src.distributed.float8 import convert_blocks_to_float8
    from src.models.mini_llm.model import MiniLLM

    for fast in (False, True):
        model = MiniLLM(vocab_size=256, dim=64, n_layers=1, n_heads=4)
        convert_blocks_to_float8(model, recipe, fsdp_float8_all_gather=False, emulate=True, fast_accum=fast)
        configs = [m.config for m in model.modules() if isinstance(m, Float8Linear)]
        assert len(configs) == 4 and all(c.gemm_config_output.use_fast_accum for c in configs)
        assert all(c.gemm_config_grad_input.use_fast_accum is fast and c.gemm_config_grad_weight.use_fast_accum is fast for c in configs)


@pytest.mark.parametrize("overrides,gathered", [
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise"], True),  # tensorwise under FSDP2: float8 wrapper weights
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise", "precision.fp8_all_gather=false"], False),
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=rowwise"], False),
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=rowwise_with_gw_hp"], False),
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise", "sharding=none"], False),
    ([], False),  # the default: Triton's casts of plain bf16 weights
])
def test_only_float8_gathered_weights_keep_the_triton_optimizer_out(overrides, gathered):
    """Rowwise recipes (and tensorwise without the float8 all-gather) leave the weights plain bf16
    parameters, so kernels=auto may still time and pick the Triton AdamW beside their float8 GEMMs."""
    from src.distributed.float8 import gathers_float8
    from src.fusion.measure import optimizer_swappable

    cfg = compose_config(["+exp=fsdp4", "precision=fp8", "backend=cuda", *overrides])  # the seed's step: no clipping
    assert gathers_float8(cfg.precision, cfg.sharding.strategy) is gathered
    assert (optimizer_swappable(cfg) is not None) is gathered


@pytest.mark.parametrize("overrides,folds", [
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise"], True),  # unset: wherever it applies
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_hp", "precision.fp8_act_in_cast=true"], True),
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise", "precision.fp8_act_in_cast=false"], False),
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise"], False),  # torchao's casts take no activation
    ([], True),  # the default: Triton's casts, rowwise_with_gw_tensorwise
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_hp", "model.mlp=swiglu"], False),  # SwiGLU: gw_tensorwise only
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise", "model.mlp=swiglu"], True),
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise", "model.mlp=swiglu", "precision.fp8_act_in_cast=false"], False),
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise", "model.mlp=swiglu", "precision.fp8_act_in_cast=true"], True),
    (["model=llama3_tiny", "precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_tensorwise", "precision.fp8_act_in_cast=true"], True),
])
def test_the_mlps_activation_goes_into_the_casts_where_it_applies(overrides, folds):
    from src.distributed.float8 import act_in_cast

    cfg = compose_config(["precision=fp8", "backend=cuda", "dist.nproc=1", "tracking=none", *overrides])
    assert act_in_cast(cfg.precision, cfg.model.mlp) is folds
    validate(cfg, cuda_device_count=1, mps_available=False, cuda_capability=H200)


@pytest.mark.parametrize("overrides,message", [
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=tensorwise", "precision.fp8_act_in_cast=true"], "precision.fp8_act_in_cast=true applies the MLP's activation inside kernels/triton's float8 casts; "
     "precision.fp8_impl=torchao casts elsewhere: set precision.fp8_impl=triton, or leave precision.fp8_act_in_cast unset"),
    (["precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_hp", "precision.fp8_act_in_cast=true", "model.mlp=swiglu"],
     "precision.fp8_act_in_cast=true runs the SwiGLU MLP's grad-weight GEMMs on the float8 casts it writes (never the bf16 activations); "
     "precision.fp8_recipe=rowwise_with_gw_hp wants them in bf16: set precision.fp8_recipe=rowwise_with_gw_tensorwise, or leave "
     "precision.fp8_act_in_cast unset"),
])
def test_the_activation_in_the_casts_is_refused_where_it_cannot_apply(overrides, message):
    assert _refusal_on_an_h200(["precision=fp8", "backend=cuda", "dist.nproc=1", "tracking=none", *overrides]) == message
    with pytest.raises(ConfigError, match="fp8_act_in_cast"):
        compose_config(["precision=fp8", "precision.fp8_act_in_cast=sometimes"])


@pytest.mark.parametrize("overrides,message", [
    (["precision=bf16"], "precision.fp8_head=true runs the head's logits GEMM in float8, and precision=bf16 trains none: set precision=fp8 "
     "precision.fp8_impl=triton, or precision.fp8_head=false"),
    (["precision.fp8_impl=torchao", "precision.fp8_recipe=rowwise"], "precision.fp8_head=true casts the head with kernels/triton's float8 casts; "
     "precision.fp8_impl=torchao casts elsewhere: set precision.fp8_impl=triton, or precision.fp8_head=false"),
    (["kernels.fused=[]"], "precision.fp8_head=true runs in the fused head and loss, and kernels.fused=[] leaves them apart: add linear_cross_entropy "
     "to kernels.fused, or set precision.fp8_head=false"),
    (["model.vocab_size=1000"], "precision.fp8_head=true: model.vocab_size is 1000, not a multiple of 16 (float8 GEMMs need every dimension a "
     "multiple of 16); set precision.fp8_head=false"),
])
def test_a_float8_head_is_refused_in_one_line_where_it_cannot_run(overrides, message):
    assert _refusal_on_an_h200(["+exp=llama3_1b_fp8", "model=llama3_tiny", "precision.fp8_head=true", "tracking=none", *overrides]) == message


def _refusal_on_an_h200(overrides: list[str]) -> str:
    """The one line validate refuses these overrides with, on one H200 (it must refuse)."""
    cfg = compose_config(overrides)
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_device_count=1, mps_available=False, cuda_capability=H200)
    return str(err.value)


def test_a_float8_head_composes_with_the_preset_and_sets_the_fused_head():
    from src.distributed.float8 import float8_head
    from src.fusion.registry import apply_fused
    from src.models import meta_model

    cfg = compose_config(["+exp=llama3_1b_fp8", "model=llama3_tiny", "precision.fp8_head=true", "tracking=none"])
    validate(cfg, cuda_device_count=1, mps_available=False, cuda_capability=H200)
    model = meta_model(cfg.model)
    assert not float8_head(model)  # the plain nn.Linear head: nothing to set
    apply_fused(model, ["linear_cross_entropy"])
    assert float8_head(model) and model.head.float8


def test_kernels_auto_keeps_the_fused_head_that_a_float8_head_runs_in(caplog):
    """A diagnosis that never names the fused head (the seed's, timed before it existed) does not refuse or drop
    precision.fp8_head under kernels=auto: the float8 logits GEMM is the precision setting's, so auto's choice
    keeps the fused head beside what it picked, and says so."""
    from src.fusion.choice import apply_auto_choice

    fixture = str(Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json")
    base = ["+exp=fsdp4_fp8", "dist.nproc=1", "kernels=auto", f"kernels.diagnosis={fixture}", "precision.fp8_impl=triton",
            "precision.fp8_recipe=rowwise_with_gw_tensorwise"]
    for head, kept in ((True, True), (False, False)):
        cfg = compose_config([*base, f"precision.fp8_head={str(head).lower()}"])
        validate(cfg, cuda_device_count=1, mps_available=False, cuda_capability=H200)
        with caplog.at_level("INFO", logger="src.run"):
            caplog.clear()
            apply_auto_choice(cfg, Path.cwd(), measure=False)
        assert ("linear_cross_entropy" in cfg.kernels.fused) is kept
        assert ("precision.fp8_head=true runs in the fused head and loss" in caplog.text) is kept
        assert "rms_norm" in cfg.kernels.fused  # the diagnosis's own picks stay
