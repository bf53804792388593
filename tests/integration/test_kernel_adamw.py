"""kernels/triton/adamw.py and optim.impl=triton against torch's AdamW (Triton's interpreter on a
CPU, the GPU where there is one): the update of odd-sized tensors over several steps, the
gradients' sum of squares, state dicts that load both ways, and a run's losses and grad norms."""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch

from perflab_kernels.triton.adamw import TritonAdamW, global_norm_from_squares
from src.config.compose import ConfigError, compose_config
from src.runtime import RunContext
from src.train.optimizer import build_optimizer, norm_in_update

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# sizes that straddle the 2048-element block: one element, a block less one, a block and one, a
# matrix, and one of two whole 16K-element tiles and a part (the unmasked path)
SHAPES = [(1,), (2047,), (2049,), (37, 113), (3, 5, 7), (131, 257)]
# fp32 update, a different order of the same operations than torch's kernel: a few ulps after 3 steps
RTOL, ATOL = 1e-5, 1e-6
HYPER = {"lr": 1e-2, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _params(seed: int = 0) -> list[torch.nn.Parameter]:
    g = torch.Generator().manual_seed(seed)
    return [torch.nn.Parameter(torch.randn(s, generator=g).to(DEVICE)) for s in SHAPES]


def _grads(step: int, dtype: torch.dtype) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(100 + step)
    return [torch.randn(s, generator=g).to(DEVICE, dtype) for s in SHAPES]


def test_triton_adamw_follows_torchs_adamw_over_steps_and_sums_the_squared_gradients():
    ours, ref = _params(), _params()
    opt, torch_opt = TritonAdamW(ours, **HYPER), torch.optim.AdamW(ref, foreach=False, **HYPER)
    for step in range(3):
        grads = _grads(step, torch.float32)
        for p, q, g in zip(ours, ref, grads):
            p.grad, q.grad = g, g.clone()
        opt.grad_norm_wanted = True
        opt.step()
        torch_opt.step()
        want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in grads]))
        torch.testing.assert_close(opt.last_grad_norm, want, rtol=1e-5, atol=0)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
        for key in ("exp_avg", "exp_avg_sq"):
            torch.testing.assert_close(opt.state[p][key], torch_opt.state[q][key], rtol=RTOL, atol=ATOL)
        assert float(opt.state[p]["step"]) == float(torch_opt.state[q]["step"]) == 3.0


def test_the_kernel_reads_bf16_gradients_as_their_fp32_values():
    """FSDP2 with reduce_dtype below fp32 and no upcast would hand bf16 gradients: the kernel reads
    them as fp32 (exactly), so the update equals the fp32 update of the same values."""
    from perflab_kernels.triton.adamw import TileTable, adamw_step_

    params = [p.detach() for p in _params()]
    want = [p.clone() for p in params]
    grads = _grads(0, torch.bfloat16)
    moments = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    table = TileTable([p.numel() for p in params], params[0].device)
    hyper = {"step": 1, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    sq = adamw_step_(params, grads, moments[0], moments[1], table, want_squares=True, **hyper)
    adamw_step_(want, [g.float() for g in grads], moments[2], moments[3], table, **hyper)
    for got, ref in zip(params + moments[0] + moments[1], want + moments[2] + moments[3]):
        assert torch.equal(got, ref)
    torch.testing.assert_close(sq, sum(g.float().square().sum() for g in grads), rtol=1e-5, atol=0)


@pytest.mark.parametrize("as_on_cuda", [False, True], ids=["this_device", "factor_rounded_as_on_cuda"])
@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
def test_the_clipping_factor_multiplied_in_the_update_gives_the_clipped_gradients_bits(grad_dtype, as_on_cuda, monkeypatch):
    """adamw_step_ with grad_mul: the same parameters and moments, bit for bit, as
    clip_grads_with_norm_'s in-place multiply on this device (rounded to the gradient's dtype) and
    then the update, for fp32 and bf16 gradients; the gradients themselves are left as they were,
    and the squares summed are the unclipped gradients'. On CUDA torch rounds the fp32 factor to
    bf16 gradients' dtype before multiplying; off CUDA the second case takes that rounding here, against
    a factor the reference rounds itself."""
    from perflab_kernels.triton import adamw
    from perflab_kernels.triton.adamw import TileTable, adamw_step_

    if as_on_cuda and DEVICE == "cuda":
        pytest.skip("on CUDA the first case is torch's own rounding")
    if as_on_cuda:
        monkeypatch.setattr(adamw, "FACTOR_ROUNDED_ON", frozenset({"cpu"}))

    params = [p.detach() for p in _params()]
    want = [p.clone() for p in params]
    grads = _grads(0, grad_dtype)
    read = [g.clone() for g in grads]
    moments = [[torch.randn(p.shape, generator=torch.Generator().manual_seed(i)).abs().to(DEVICE) for p in params] for i in range(4)]
    moments[2], moments[3] = [m.clone() for m in moments[0]], [m.clone() for m in moments[1]]
    table = TileTable([p.numel() for p in params], params[0].device)
    hyper = {"step": 3, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g.float()) for g in grads]))
    factor = torch.clamp(0.37 / (norm + 1e-6), max=1.0)  # clip_grads_with_norm_'s factor at max_norm 0.37
    assert float(factor) < 0.1
    sq = adamw_step_(params, grads, moments[0], moments[1], table, want_squares=True, grad_mul=factor.float(), **hyper)
    clipped = [g.clone() for g in grads]
    # what clip_grads_with_norm_ leaves (a CPU scalar's value is read unrounded: round it as CUDA does)
    torch._foreach_mul_(clipped, factor.to(grad_dtype) if as_on_cuda else factor)
    adamw_step_(want, clipped, moments[2], moments[3], table, **hyper)
    for got, ref in zip(params + moments[0] + moments[1], want + moments[2] + moments[3]):
        assert torch.equal(got, ref)
    assert all(torch.equal(g, r) for g, r in zip(grads, read))
    torch.testing.assert_close(sq, sum(g.float().square().sum() for g in read), rtol=1e-5, atol=0)
    with pytest.raises(ValueError, match="grad_mul is one fp32 element"):
        adamw_step_(params, grads, moments[0], moments[1], table, grad_mul=torch.ones(2, device=DEVICE), **hyper)


def test_the_update_writes_each_parameters_bf16_cast_rounded_as_torchs():
    """adamw_step_ with copies: the same update, and each copy is the updated parameter's
    .to(torch.bfloat16) bit for bit (rounded to nearest even by the bits, in the interpreter as on
    the GPU), for values on rounding ties, at overflow, subnormal and infinite; NaN stays NaN."""
    from perflab_kernels.triton.adamw import TileTable, adamw_step_

    params = [p.detach() for p in _params()]
    # ties between two bf16 values (odd and even lower halves), the largest finite fp32 (rounds to
    # inf), subnormals, infinities and a NaN, written over the first tensors' first elements
    special = torch.tensor([1.0 + 2**-8, 1.0 + 3 * 2**-8, -(1.0 + 2**-8), 3.4028235e38, -3.4028235e38, 1e-40, -3e-39,
                            float("inf"), float("-inf"), float("nan")], device=params[0].device)
    params[3].view(-1)[: special.numel()] = special
    want = [p.clone() for p in params]
    grads = _grads(0, torch.float32)
    for g in grads:  # no update where the specials sit: they reach the cast as they are
        g.view(-1)[: special.numel()] = 0.0
    moments = [[torch.zeros_like(p) for p in params] for _ in range(4)]
    copies = [torch.full_like(p, 7.0, dtype=torch.bfloat16) for p in params]
    table = TileTable([p.numel() for p in params], params[0].device)
    hyper = {"step": 1, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.0}
    adamw_step_(params, grads, moments[0], moments[1], table, copies=copies, **hyper)
    adamw_step_(want, grads, moments[2], moments[3], table, **hyper)
    for got, ref in zip(params + moments[0] + moments[1], want + moments[2] + moments[3]):
        torch.testing.assert_close(got, ref, rtol=0, atol=0, equal_nan=True)
    for written, p in zip(copies, params):
        finite = ~p.isnan()
        assert torch.equal(written[finite], p.to(torch.bfloat16)[finite])
        assert written[~finite].isnan().all()
    assert copies[3].view(-1)[:2].float().tolist() == [1.0, 1.0 + 2**-6]  # ties to even: down, then up
    with pytest.raises(ValueError, match="bf16 copy of each parameter's size"):
        adamw_step_(params, grads, moments[0], moments[1], table, copies=[c.float() for c in copies], **hyper)


def test_the_state_dict_is_adamws_and_loads_both_ways():
    """A checkpoint of torch's AdamW resumes under optim.impl=triton and the other way round: the
    same keys, the step count carried, the update continued where it stopped."""
    ref, ours = _params(), _params()
    torch_opt = torch.optim.AdamW(ref, foreach=False, **HYPER)
    for p, g in zip(ref, _grads(0, torch.float32)):
        p.grad = g
    torch_opt.step()
    with torch.no_grad():
        for p, q in zip(ours, ref):
            p.copy_(q)
    opt = TritonAdamW(ours, **HYPER)
    opt.load_state_dict(copy.deepcopy(torch_opt.state_dict()))  # as from a checkpoint: the step counts not shared
    for p, q, g in zip(ours, ref, _grads(1, torch.float32)):
        p.grad, q.grad = g, g.clone()
    opt.step()
    torch_opt.step()
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=RTOL, atol=ATOL)
    sd = opt.state_dict()
    assert set(sd["state"][0]) == {"step", "exp_avg", "exp_avg_sq"} and float(sd["state"][0]["step"]) == 2.0
    back = torch.optim.AdamW(_params(), foreach=False, **HYPER)
    back.load_state_dict(sd)
    assert float(back.state_dict()["state"][0]["step"]) == 2.0


def test_parameters_without_a_gradient_are_left_alone_and_unsupported_settings_refused():
    params = _params()
    before = params[1].detach().clone()
    opt = TritonAdamW(params, **HYPER)
    for i, (p, g) in enumerate(zip(params, _grads(0, torch.float32))):
        p.grad = None if i == 1 else g
    opt.step()
    assert torch.equal(params[1].detach(), before) and params[1] not in opt.state
    half = [torch.nn.Parameter(torch.zeros(5, device=DEVICE, dtype=torch.bfloat16))]
    half[0].grad = torch.zeros_like(half[0])
    with pytest.raises(ValueError, match="fp32 parameters"):
        TritonAdamW(half, **HYPER).step()
    opt = TritonAdamW(_params(), **HYPER)
    opt.param_groups[0]["amsgrad"] = True
    with pytest.raises(ValueError, match="amsgrad"):
        opt.step()


def test_optim_impl_triton_builds_it_and_is_refused_where_it_cannot_run(monkeypatch):
    cfg = compose_config(["optim.impl=triton"])
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg.optim, "cpu", False)
    assert isinstance(opt, TritonAdamW) and norm_in_update(opt)
    assert not norm_in_update(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(3))]))
    from src.config.validate import validate

    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(ConfigError, match="optim.impl=triton runs a Triton kernel.*backend=cpu"):
        validate(compose_config(["optim.impl=triton", "dist.nproc=1"]), cuda_device_count=0)
    with pytest.raises(ConfigError, match="optim.impl=triton updates the parameters on the GPU.*fsdp2_offload"):
        validate(compose_config(["+exp=fsdp4", "dist.nproc=1", "optim.impl=triton", "sharding=fsdp2_offload"]), cuda_device_count=1)


@pytest.mark.parametrize("value", ["1", "true", "on", "0"])
def test_the_interpreter_is_read_as_triton_reads_it(monkeypatch, value):
    """TRITON_INTERPRET as Triton's own knob parses it: each spelling that makes Triton interpret lets a
    CPU run of the Triton optimizer through the checks (only "1" did, and `true` was refused with a
    line asking for TRITON_INTERPRET=1); "0" is refused."""
    from perflab_kernels.triton.device import interpreted
    from src.config.validate import validate
    from src.fusion.registry import interpreter_fault

    monkeypatch.setenv("TRITON_INTERPRET", value)
    assert interpreted() == (value != "0")
    cfg = compose_config(["optim.impl=triton", "dist.nproc=1", "kernels=eager"])
    if value == "0":
        with pytest.raises(ConfigError, match="optim.impl=triton runs a Triton kernel.*backend=cpu"):
            validate(cfg, cuda_device_count=0)
    elif interpreter_fault():
        with pytest.raises(ConfigError, match="interpreter"):
            validate(cfg, cuda_device_count=0)
    else:
        validate(cfg, cuda_device_count=0)


def _run(tmp_path: Path, name: str, overrides: list[str], precision: str = "fp32", steps: int = 4) -> list[dict]:
    from src.train.worker import train

    run_dir = tmp_path / name
    run_dir.mkdir()
    # on a GPU the run is on it (the kernels module was imported for it); on a CPU in the interpreter
    cfg = compose_config([f"backend={'cuda' if DEVICE == 'cuda' else 'cpu'}", "dist.nproc=1", f"precision={precision}", f"train.steps={steps}", "data.seq_len=64",
                          "data.batch_size=4", "tracking=none", "train.progress=false", "optim.grad_clip=0", *overrides])
    train(cfg, RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def test_a_run_with_optim_impl_triton_trains_as_foreach_adamw_and_reports_the_same_grad_norms(tmp_path: Path, in_process_runs):
    """The tiny model under FSDP2 over a 1-rank mesh (DTensor parameters, gradients and moments),
    in fp32, no clipping: 4 steps give foreach AdamW's losses and grad norms, the norms now summed
    inside the update's own pass."""
    ours = _run(tmp_path, "triton", ["optim.impl=triton"])
    ref = _run(tmp_path, "foreach", ["optim.impl=foreach"])
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref], rel=1e-5)
    assert [m["grad_norm"] for m in ours] == pytest.approx([m["grad_norm"] for m in ref], rel=1e-5)
    assert all(m["grad_norm"] > 0 for m in ours)


def test_a_clipped_run_with_the_factor_in_the_update_gives_the_bits_of_one_that_clips_in_a_pass(tmp_path: Path, in_process_runs):
    """optim.impl=triton with optim.grad_clip: speed.clip_in_update hands the update kernel the
    clipping factor (FSDP2's DTensor gradients over a 1-rank mesh, the factor a plain scalar); the
    losses and grad norms are those of clip_grads_with_norm_'s pass then the update, bit for bit,
    on a clip small enough that every step clips."""
    common = ["optim.impl=triton", "optim.grad_clip=0.05"]
    folded = _run(tmp_path, "folded", [*common, "speed.clip_in_update=true"], steps=3)
    separate = _run(tmp_path, "separate", [*common, "speed.clip_in_update=false"], steps=3)
    assert min(m["grad_norm"] for m in separate) > 0.05
    assert [(m["loss"], m["grad_norm"]) for m in folded] == [(m["loss"], m["grad_norm"]) for m in separate]


def test_a_run_with_bf16_moments_trains_as_one_with_fp32_moments(tmp_path: Path, in_process_runs):
    """optim.state_dtype=bfloat16 through the trainer: the tiny model's 4 losses within 1e-3 of those
    with fp32 moments, and not the same (lr 1e-2, so the moments' rounding reaches the loss)."""
    ref = _run(tmp_path, "fp32_moments", ["optim.impl=triton", "optim.lr=1e-2"])
    ours = _run(tmp_path, "bf16_moments", ["optim.impl=triton", "optim.lr=1e-2", "optim.state_dtype=bfloat16"])
    assert [m["loss"] for m in ours] == pytest.approx([m["loss"] for m in ref], rel=1e-3)
    assert [m["loss"] for m in ours] != [m["loss"] for m in ref]


def test_a_bf16_run_whose_update_writes_the_unsharded_parameters_trains_as_one_that_casts_them(tmp_path: Path, in_process_runs, caplog):
    """speed.cast_in_step on one rank in bf16 (asked for: on a CPU `auto` keeps torch's path): the update writes each parameter's bf16
    cast into FSDP2's kept unsharded storage; the losses and grad norms are those of FSDP2 casting
    every parameter at every unshard, bit for bit, and so are a run's resumed from a checkpoint."""
    import logging

    base = ["optim.impl=triton", "checkpoint.enabled=true", "checkpoint.interval=3", "speed.one_rank_copies=on", "speed.cast_in_step=on"]
    with caplog.at_level(logging.INFO, logger="src"):
        kept = _run(tmp_path, "kept", base, precision="bf16", steps=6)
    assert any("speed.cast_in_step: the Triton AdamW update writes" in r.getMessage() for r in caplog.records)
    cast = _run(tmp_path, "cast", [*base, "speed.cast_in_step=off"], precision="bf16", steps=6)
    assert [(m["loss"], m["grad_norm"]) for m in kept] == [(m["loss"], m["grad_norm"]) for m in cast]
    # from the kept run's step-3 checkpoint, with its kept casts forgotten at the load
    resumed = _run(tmp_path, "resumed", [*base, f"checkpoint.resume={tmp_path / 'kept' / 'checkpoints' / 'step_00000003'}"],
                   precision="bf16", steps=6)
    assert [m["loss"] for m in resumed] == [m["loss"] for m in kept][3:]


def test_on_two_gloo_ranks_the_norm_summed_in_the_update_is_the_global_one(tmp_path: Path, monkeypatch):
    """FSDP2 over 2 CPU ranks: each rank's update sums the squares of its own gradient shards, and
    the all-reduce over the sharded mesh dimension makes the global norm, foreach AdamW's (whose
    get_total_norm reduces DTensor norms); the losses follow foreach's too."""
    from src.fusion.registry import interpreter_fault
    from tests.support.cli import run_cli

    fault = interpreter_fault()
    if fault:  # the run's checks refuse it (a GPU image's triton 3.6 with numpy 2.5 failed so)
        pytest.skip(fault)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    metrics = {}
    for impl in ("triton", "foreach"):
        cwd = tmp_path / impl
        cwd.mkdir()
        proc = run_cli(["dist.nproc=2", "precision=fp32", "train.steps=3", "data.seq_len=64", "data.batch_size=4", "tracking=none",
                        "optim.grad_clip=0", f"optim.impl={impl}"], cwd=cwd, timeout=600)
        assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
        (path,) = list(cwd.glob("outputs/*/*/metrics.jsonl"))
        metrics[impl] = [json.loads(line) for line in path.read_text().splitlines()]
    for key in ("loss", "grad_norm"):
        assert [m[key] for m in metrics["triton"]] == pytest.approx([m[key] for m in metrics["foreach"]], rel=1e-5), key


def test_one_rank_sums_the_norm_without_a_collective(tmp_path: Path, monkeypatch):
    """A mesh dimension of one rank holds the whole sum already: no all-reduce over it (on one GPU it
    would be the run's first collective, and start NCCL at the first logged step). Two ranks do
    reduce: the test above."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'rdzv'}", rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1, 1))
        reduced, all_reduce = [], dist.all_reduce
        monkeypatch.setattr(dist, "all_reduce", lambda *a, **k: reduced.append(a) or all_reduce(*a, **k))
        norm = global_norm_from_squares([torch.tensor(9.0), torch.tensor(16.0)], (mesh, (0, 1)), torch.device("cpu"))
        assert float(norm) == 5.0 and reduced == []
    finally:
        dist.destroy_process_group()


def test_tensors_off_a_16_byte_boundary_take_the_unhinted_path_and_the_same_update():
    """A parameter that is a view one element into its buffer (4 bytes off 16): the launch drops its
    alignment hints and the update equals the aligned tensors' update of the same values."""
    from perflab_kernels.triton.adamw import TileTable, adamw_step_

    g = torch.Generator().manual_seed(3)
    n = 40000  # two whole 16K-element tiles (the unmasked path) and a part
    buf = torch.randn(n + 1, generator=g).to(DEVICE)
    shifted, aligned = buf[1:], buf[1:].clone()
    grad = torch.randn(n, generator=g).to(DEVICE)
    assert shifted.data_ptr() % 16 and not aligned.data_ptr() % 16
    table = TileTable([n], buf.device)
    hyper = {"step": 1, "lr": 1e-2, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
    moments = [torch.zeros(n, device=DEVICE) for _ in range(4)]
    adamw_step_([shifted], [grad], [moments[0]], [moments[1]], table, **hyper)
    adamw_step_([aligned], [grad], [moments[2]], [moments[3]], table, **hyper)
    assert torch.equal(shifted, aligned) and torch.equal(moments[0], moments[2])


@pytest.mark.skipif(DEVICE != "cuda", reason="torch's fused AdamW keeps its step count on the GPU")
def test_a_fused_adamw_checkpoint_resumes_with_its_step_count_moved_to_the_host():
    ref, ours = _params(), _params()
    fused = torch.optim.AdamW(ref, fused=True, **HYPER)
    for p, g in zip(ref, _grads(0, torch.float32)):
        p.grad = g
    fused.step()
    assert fused.state[ref[0]]["step"].is_cuda
    opt = TritonAdamW(ours, **HYPER)
    opt.load_state_dict(copy.deepcopy(fused.state_dict()))
    for p, g in zip(ours, _grads(1, torch.float32)):
        p.grad = g
    opt.step()
    assert all(opt.state[p]["step"].device.type == "cpu" and float(opt.state[p]["step"]) == 2.0 for p in ours)


def test_a_checkpoint_resumed_under_other_kernels_steps_with_the_runs_own():
    """A TritonAdamW checkpoint loaded by a fused AdamW (a resume under optim.impl=fused, or another
    pick of kernels=auto): loading replaces the param groups' kernel flags with the checkpoint's, and
    the fused update's clipping divisor then fails in the for-loop path; the Checkpointer puts the
    run's flags back, and the resumed step takes the divisor."""
    from src.train.checkpoint import keep_optimizer_kernels, optimizer_kernels

    saved = TritonAdamW(_params(), **HYPER)
    for p, g in zip(saved.param_groups[0]["params"], _grads(0, torch.float32)):
        p.grad = g
    saved.step()
    params = _params()
    fused = torch.optim.AdamW(params, fused=True, **HYPER)
    kernels = optimizer_kernels(fused)
    fused.load_state_dict(copy.deepcopy(saved.state_dict()))
    assert not fused.param_groups[0]["fused"]  # what loading alone leaves
    keep_optimizer_kernels(fused, kernels)
    assert fused.param_groups[0]["fused"] is True
    for p, g in zip(params, _grads(1, torch.float32)):
        p.grad = g
    fused.grad_scale = torch.tensor(2.0, device=DEVICE)  # speed.clip_in_update's divisor
    fused.step()
    del fused.grad_scale
    assert float(fused.state[params[0]]["step"]) == 2.0 and fused.state[params[0]]["step"].device == params[0].device


def _bf16_neighbours(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The bf16 values just below and just above x's magnitude (x > 0): truncated and truncated + 1 ulp."""
    bits = x.float().view(torch.int32)
    low = (bits >> 16) << 16
    return low.view(torch.float32), (low + (1 << 16)).view(torch.float32)


def test_bf16_moments_are_rounded_stochastically_unbiased_and_the_same_bits_however_the_tensor_is_split():
    """v = 1 and a gradient of 2 with beta2 = 0.999: v becomes 1.003, under half a bf16 ulp (0.0039)
    above 1, so rounded to nearest it would stay 1 every step and never follow the gradients.
    Rounded stochastically each element is 1 or 1.0078, and their mean is 1.003. The bits are a
    hash of (the step's key, random base + index): the tensor updated in two parts whose bases
    continue each other (an FSDP2 shard's) gives the same bits as whole; another key, other bits."""
    from perflab_kernels.triton.adamw import TileTable, adamw_step_

    n, half = 40000, 17000
    hyper = {"step": 1, "lr": 1e-3, "beta1": 0.9, "beta2": 0.999, "eps": 1e-8, "weight_decay": 0.0}

    def update(parts: list[tuple[int, int]], key: int) -> tuple[torch.Tensor, torch.Tensor]:
        p = torch.zeros(n, device=DEVICE)
        g = torch.full((n,), 2.0, device=DEVICE)
        m = torch.full((n,), 0.3, device=DEVICE, dtype=torch.bfloat16)
        v = torch.ones(n, device=DEVICE, dtype=torch.bfloat16)
        views = [slice(a, b) for a, b in parts]
        adamw_step_([p[s] for s in views], [g[s] for s in views], [m[s] for s in views], [v[s] for s in views],
                    TileTable([b - a for a, b in parts], p.device), rand_bases=[(5 << 32) + a for a, _ in parts], rounding_key=key, **hyper)
        return m, v

    m, v = update([(0, n)], key=11)
    v32 = torch.tensor(0.999 * 1.0 + 0.001 * 4.0)
    lo, hi = _bf16_neighbours(v32)
    assert set(v.float().unique().tolist()) == {lo.item(), hi.item()}
    # the mean of n draws of lo or hi: v32 within 5 standard errors (p(hi) = 0.38, 0.0078 apart)
    assert abs(v.float().mean().item() - v32.item()) < 5 * (hi - lo).item() * 0.5 / n**0.5
    m32 = torch.tensor(0.9 * 0.30078125 + 0.1 * 2.0)  # 0.3 as bf16 holds 0.30078125
    assert abs(m.float().mean().item() - m32.item()) < 5 * (_bf16_neighbours(m32)[1] - _bf16_neighbours(m32)[0]).item() / n**0.5
    m_split, v_split = update([(0, half), (half, n)], key=11)
    assert torch.equal(m_split, m) and torch.equal(v_split, v)
    _, v_other = update([(0, n)], key=12)
    assert not torch.equal(v_other, v)


def test_bf16_moments_follow_fp32_adamw_and_checkpoints_load_across_state_dtypes():
    """TritonAdamW(state_dtype=bf16) over 4 steps: moments stored in bf16 (2 bytes each), the
    parameters within 1% of an update of fp32 moments' run (bf16 keeps 8 bits: 0.4% a rounding).
    A bf16-moment checkpoint loaded by an fp32 one (torch's load casts the moments to the
    parameters' dtype) and back: each run steps on with its own moments' dtype."""
    p0 = _params()
    ref = [torch.nn.Parameter(p.detach().clone()) for p in p0]
    ours = [torch.nn.Parameter(p.detach().clone()) for p in p0]
    fp32 = TritonAdamW(ref, **HYPER)
    bf16 = TritonAdamW(ours, **HYPER, state_dtype=torch.bfloat16, seed=3)
    for step in range(4):
        for group, opt in ((ref, fp32), (ours, bf16)):
            for p, g in zip(group, _grads(step, torch.float32)):
                p.grad = g
            opt.step()
    assert all(bf16.state[p][k].dtype == torch.bfloat16 for p in ours for k in ("exp_avg", "exp_avg_sq"))
    for a, b, start in zip(ours, ref, p0):
        moved = (b - start).abs().max()
        assert (a - b).abs().max() <= 0.01 * moved, float((a - b).abs().max() / moved)
    as_fp32 = TritonAdamW([torch.nn.Parameter(p.detach().clone()) for p in ours], **HYPER)
    as_fp32.load_state_dict(copy.deepcopy(bf16.state_dict()))
    back = TritonAdamW([torch.nn.Parameter(p.detach().clone()) for p in ours], **HYPER, state_dtype=torch.bfloat16, seed=3)
    back.load_state_dict(copy.deepcopy(bf16.state_dict()))
    for opt in (as_fp32, back):
        for p, g in zip(opt.param_groups[0]["params"], _grads(4, torch.float32)):
            p.grad = g
        opt.step()
    assert all(as_fp32.state[p]["exp_avg_sq"].dtype == torch.float32 for p in as_fp32.param_groups[0]["params"])
    assert all(back.state[p]["exp_avg_sq"].dtype == torch.bfloat16 for p in back.param_groups[0]["params"])
    # the bf16 run resumed from its own checkpoint steps as the run that never stopped
    for p, g in zip(ours, _grads(4, torch.float32)):
        p.grad = g
    bf16.step()
    for a, b in zip(back.param_groups[0]["params"], ours):
        assert torch.equal(a, b) and torch.equal(back.state[a]["exp_avg_sq"], bf16.state[b]["exp_avg_sq"])


def test_optim_state_dtype_bfloat16_is_built_for_triton_and_refused_for_torchs_kernels():
    cfg = compose_config(["optim.impl=triton", "optim.state_dtype=bfloat16"])
    opt = build_optimizer([torch.nn.Parameter(torch.zeros(3))], cfg.optim, "cpu", False, seed=5)
    assert opt.state_dtype == torch.bfloat16 and opt.seed == 5
    from src.config.validate import validate

    with pytest.raises(ConfigError, match=r"optim.state_dtype=bfloat16 .* set optim.impl=triton \(now fused\)"):
        validate(compose_config(["optim.impl=fused", "optim.state_dtype=bfloat16", "dist.nproc=1"]), cuda_device_count=0)
    with pytest.raises(ConfigError, match=r"set optim.impl=triton \(now auto\)"):
        validate(compose_config(["optim.state_dtype=bfloat16", "dist.nproc=1"]), cuda_device_count=0)
    with pytest.raises(ConfigError, match="state_dtype"):
        compose_config(["optim.state_dtype=float16"])


def _sharded_moments_rank(rank: int, init_file: str, out: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    try:
        full = _params()
        grads = _grads(0, torch.float32)
        # FSDP2's layout (Shard(0)) on a 1-D mesh and HSDP's (Replicate(), Shard(0)) on a 1 x 2 one; 37 and 131 rows split unevenly
        meshes = {"fsdp": (init_device_mesh("cpu", (2,)), [Shard(0)]), "hsdp": (init_device_mesh("cpu", (1, 2)), [Replicate(), Shard(0)])}
        got = {}
        for name, (mesh, placements) in meshes.items():
            params = [torch.nn.Parameter(distribute_tensor(p.detach().clone(), mesh, placements)) for p in full]
            for p, g in zip(params, grads):
                p.grad = distribute_tensor(g.clone(), mesh, placements)
            opt = TritonAdamW(params, **HYPER, state_dtype=torch.bfloat16, seed=9)
            opt.step()
            got[name] = [opt.state[p]["exp_avg_sq"].full_tensor() for p in params]
            del opt, params
        if rank == 0:
            torch.save(got, out)
    finally:
        import gc

        gc.collect()
        dist.destroy_process_group()


def test_bf16_moments_of_fsdp2_shards_are_the_unsharded_optimizers_bits(tmp_path: Path):
    """Each shard's random stream starts at its first element's index in the whole parameter, so the
    moments of parameters sharded over 2 gloo ranks (FSDP2's and HSDP's placements, uneven shards
    among them) are, gathered, the same bits as one optimizer's over the whole parameters."""
    if DEVICE != "cpu":
        pytest.skip("gloo ranks on the CPU, in Triton's interpreter")
    from tests.support.ranks import spawn_ranks

    out = tmp_path / "rank0.pt"
    spawn_ranks(_sharded_moments_rank, (str(tmp_path / "rdzv"), str(out)), 2)
    got = torch.load(out, weights_only=True)
    params = _params()
    for p, g in zip(params, _grads(0, torch.float32)):
        p.grad = g
    whole = TritonAdamW(params, **HYPER, state_dtype=torch.bfloat16, seed=9)
    whole.step()
    want = [whole.state[p]["exp_avg_sq"] for p in params]
    for name, moments in got.items():
        assert all(torch.equal(a, b) for a, b in zip(moments, want)), name


@pytest.mark.skipif(DEVICE != "cuda", reason="Triton compiles on a GPU only; its interpreter compiles nothing")
def test_the_first_step_compiles_the_norm_summing_variant_too():
    """A run that reads the norm at its logging steps only would compile the summing variant at the
    first of them, mid-run: the first step compiles both, and that later step compiles nothing."""
    from perflab_kernels.triton.adamw import _BOTH_COMPILED, _adamw_tiles

    kernels = _adamw_tiles.device_caches[torch.cuda.current_device()][0]
    kernels.clear()  # what earlier tests compiled (loaded again from Triton's disk cache if asked for)
    _BOTH_COMPILED.clear()
    params = _params()
    opt = TritonAdamW(params, **HYPER, seed=3)
    for p, g in zip(params, _grads(0, torch.float32)):
        p.grad = g
    opt.step()
    assert len(kernels) == 2  # the update, and the update that sums the squares
    opt.grad_norm_wanted = True
    opt.step()
    assert len(kernels) == 2
    want = torch.linalg.vector_norm(torch.cat([g.flatten() for g in _grads(0, torch.float32)]))
    torch.testing.assert_close(opt.last_grad_norm, want, rtol=1e-5, atol=0)
