"""kernels=compile trains to eager's fp32 losses; optim.impl picks AdamW's kernels (in process, one rank)."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from src.config.compose import ConfigError, compose_config
from src.runtime import RunContext
from src.train.optimizer import build_optimizer, optimizer_impl

# 1 rank keeps the launcher out (the ranks' start-up is most of a 2-rank CLI run's ~20 s here);
# FSDP2 still shards over the 1-rank mesh, so compile meets fully_shard as in any run.
SMALL = ["dist.nproc=1", "precision=fp32", "train.steps=4", "data.seq_len=64", "data.batch_size=4", "tracking=none", "train.progress=false"]


def _losses(tmp_path: Path, name: str, overrides: list[str]) -> list[float]:
    from src.train.worker import train

    run_dir = tmp_path / name
    run_dir.mkdir()
    cfg = compose_config([*SMALL, *overrides])
    train(cfg, RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_compiled_blocks_give_the_eager_fp32_losses(tmp_path: Path, in_process_runs):
    """Our kernels=compile (each block compiled in place, then fully_shard) against eager, 4 steps in
    fp32: equal within 1e-5 relative. The graphs go through Dynamo and AOTAutograd (backend
    aot_eager), as with Inductor; Inductor's own code generation is left out here because its
    cold CPU compile of the tiny block took 31 s on this 2-core machine (test_gpu runs it)."""
    from torch._dynamo.utils import counters

    eager = _losses(tmp_path, "eager", [])
    counters.clear()
    compiled = _losses(tmp_path, "compile", ["kernels=compile", "kernels.compile_backend=aot_eager"])
    assert counters["stats"]["unique_graphs"] >= 1 and not counters["graph_break"]  # compiled, in one graph per block
    assert len(eager) == 4 and eager[-1] < eager[0]
    assert compiled == pytest.approx(eager, rel=1e-5)


def test_inductor_settings_hold_for_the_run_and_are_put_back():
    """speed.cudagraphs, and float8's emulate_precision_casts under torchao's rowwise recipes, are
    Inductor config while the run trains (its blocks' backward graphs compile lazily, inside it) and
    nothing after; a run that needs neither sets nothing."""
    import torch._inductor.config as inductor

    from src.speed.inductor import inductor_config, run_settings

    assert run_settings(compose_config(["kernels=compile"])) == {}
    with inductor.patch({"triton.cudagraphs": False, "emulate_precision_casts": False}):  # whatever the environment says
        with inductor_config(compose_config(["kernels=compile", "speed.cudagraphs=true"])):
            assert inductor.triton.cudagraphs and not inductor.emulate_precision_casts
        assert not inductor.triton.cudagraphs
        with inductor_config(compose_config(["precision=fp8", "precision.fp8_impl=torchao", "precision.fp8_recipe=rowwise"])):
            assert inductor.emulate_precision_casts and not inductor.triton.cudagraphs
        assert not inductor.emulate_precision_casts
        with inductor_config(compose_config(["precision=fp8", "precision.fp8_impl=triton", "precision.fp8_recipe=rowwise_with_gw_hp"])):
            assert not inductor.emulate_precision_casts  # the Triton casts round as eager does


def test_a_float8_job_leaves_emulate_precision_casts_as_it_found_it(tmp_path: Path, in_process_runs, monkeypatch):
    """A whole float8 run (torchao's rowwise recipe, on the CPU's float8 GEMMs, one rank) in this
    process: the setting holds while it trains and is torch's own again after it, so the next
    in-process job does not inherit it."""
    import torch._inductor.config as inductor

    from src.train.trainer import Trainer

    pytest.importorskip("torchao")  # pip install -e ".[fp8]"
    seen = []
    train = Trainer.train
    monkeypatch.setattr(Trainer, "train", lambda self: seen.append(inductor.emulate_precision_casts) or train(self))
    before = inductor.emulate_precision_casts
    losses = _losses(tmp_path, "fp8", ["precision=fp8", "precision.fp8_impl=torchao", "precision.fp8_recipe=rowwise", "precision.param_dtype=bfloat16"])
    assert seen == [True] and inductor.emulate_precision_casts is before is False
    assert len(losses) == 4


def test_optimizer_impl_chooses_the_adamw_kernels():
    params = [torch.nn.Parameter(torch.zeros(3))]
    cfg = compose_config([])
    for impl, fused, foreach in (("fused", True, None), ("foreach", None, True), ("for_loop", None, False)):
        cfg.optim.impl = impl
        opt = build_optimizer(params, cfg.optim, "cpu", False)
        assert (opt.defaults["fused"], opt.defaults["foreach"]) == (fused, foreach), impl
    assert optimizer_impl("auto", "cuda", False) == "fused"  # the default on GPUs is unchanged
    assert optimizer_impl("auto", "cuda", True) == "foreach" and optimizer_impl("auto", "cpu", False) == "foreach"
    with pytest.raises(ConfigError, match="optim.impl=fusd"):
        compose_config(["optim.impl=fusd"])


def test_clipping_inside_the_fused_update_gives_the_clipped_step(tmp_path: Path, in_process_runs):
    """speed.clip_in_update: fused AdamW dividing each gradient by the clipping factor as it reads
    it gives the step clip_grads_with_norm_ then AdamW gives: 4 steps of fp32 losses within 1e-6 and
    the same grad norms, on a clip small enough that every step clips (FSDP2 over the 1-rank mesh:
    the parameters and gradients are DTensors, the divisor a plain device scalar)."""
    common = ["optim.impl=fused", "optim.grad_clip=0.05"]
    folded = _losses(tmp_path, "folded", [*common, "speed.clip_in_update=true"])
    separate = _losses(tmp_path, "separate", [*common, "speed.clip_in_update=false"])
    norms = {name: [json.loads(line)["grad_norm"] for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
             for name in ("folded", "separate")}
    assert min(norms["separate"]) > 0.05  # every step clipped
    assert folded == pytest.approx(separate, rel=1e-6)
    assert norms["folded"] == pytest.approx(norms["separate"], rel=1e-5)


def test_clipping_factor_rides_in_fused_adamw_only():
    """The fold applies to torch's fused Adam/AdamW (their step reads grad_scale) and to
    optim.impl=triton's (tests/integration/test_kernel_adamw.py); foreach and for-loop AdamW refuse a divisor,
    so they keep clip_grads_with_norm_'s pass. Either way the gradients left behind are the clipped
    ones (clip_grads_with_norm_ takes the parameters: handed the gradients themselves it found no
    .grad and clipped nothing)."""
    from src.train.loop import folds_clip, optimizer_step

    cfg = compose_config(["optim.grad_clip=1.0"])
    for impl, folds in (("fused", True), ("foreach", False), ("for_loop", False)):
        cfg.optim.impl = impl
        model = torch.nn.Linear(4, 3)
        opt = build_optimizer(model.parameters(), cfg.optim, "cpu", False)
        assert folds_clip(opt) == folds, impl
        model(torch.randn(5, 4) * 100).square().sum().backward()  # a norm far above 1
        grads = [p.grad.clone() for p in model.parameters()]
        norm = optimizer_step(model, opt, grad_clip=1.0, clip_in_update=True)
        assert not hasattr(opt, "grad_scale")  # the divisor goes with the step
        scale = (norm + 1e-6) / 1.0
        for p, g in zip(model.parameters(), grads):  # the gradients left behind are the clipped ones either way
            torch.testing.assert_close(p.grad, g / scale, rtol=1e-6, atol=1e-7)
