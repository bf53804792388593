"""The config tree composes, and every impossible setting fails before anything starts, in one line."""
from __future__ import annotations

from pathlib import Path

import pytest
from omegaconf import OmegaConf

from src.config import GROUPS
from src.config.compose import CONF_DIR, ConfigError, compose_config
from src.config.validate import validate
from src.run import preflight
from tests.support.cli import run_cli

MODELS = ", ".join(sorted(p.stem for p in (CONF_DIR / "model").glob("*.yaml")))  # conf/model/'s options, as --help lists them

EXPS = sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml"))
GROUP_OPTIONS = [(g, p.stem) for g in GROUPS for p in sorted((CONF_DIR / g).glob("*.yaml"))]


def test_defaults_compose_to_the_cpu_fsdp2_run():
    cfg = compose_config([])
    assert (cfg.model.name, cfg.sharding.name, cfg.precision.name, cfg.backend.name) == ("tiny", "fsdp2", "bf16", "cpu")
    assert (cfg.data.name, cfg.tracking.name, cfg.task.name, cfg.kernels.name) == ("text", "mlflow", "train", "eager")
    assert cfg.dist.nproc == 2
    validate(cfg, cuda_device_count=0, mps_available=False)


@pytest.mark.parametrize("exp", EXPS)
def test_every_experiment_composes(exp):
    cfg = compose_config([f"+exp={exp}"])
    assert cfg.exp == exp
    OmegaConf.to_container(cfg, resolve=True, throw_on_missing=True)


@pytest.mark.parametrize("group,option", GROUP_OPTIONS)
def test_every_group_option_composes(group, option):
    if (group, option) == ("model", "hf"):  # its shape is a folder's: tests/test_hf_auto.py
        with pytest.raises(ConfigError, match="set model.hf_path=DIR"):
            compose_config(["model=hf"])
        return
    cfg = compose_config([f"{group}={option}"])
    assert cfg[group].name == option


def test_fsdp4_is_the_seeds_run():
    cfg = compose_config(["+exp=fsdp4"])
    m = cfg.model
    assert (m.vocab_size, m.dim, m.n_layers, m.n_heads, m.ffn_mult, m.causal) == (32000, 2048, 12, 16, 4, False)
    assert (cfg.data.batch_size, cfg.data.seq_len, cfg.dist.nproc, cfg.train.steps) == (8, 1024, 4, 5)
    assert (cfg.precision.param_dtype, cfg.precision.reduce_dtype, cfg.optim.lr) == ("bfloat16", "float32", 3e-4)
    assert cfg.backend.name == "cuda" and cfg.train.seed_line
    # the command line still wins over the experiment's choices
    assert compose_config(["+exp=fsdp4", "model=tiny", "backend=cpu"]).model.name == "tiny"


def test_fsdp4_tuned_is_the_seeds_run_with_the_measured_levers():
    seed, tuned = compose_config(["+exp=fsdp4"]), compose_config(["+exp=fsdp4_tuned"])
    for group in ("model", "data", "optim", "dist", "backend"):
        assert tuned[group] == seed[group], group
    assert tuned.kernels.compile and list(tuned.kernels.fused) == ["cross_entropy"]
    assert (tuned.precision.param_dtype, tuned.precision.reduce_dtype) == ("bfloat16", "bfloat16")
    assert tuned.sharding.split_root and not tuned.sharding.reshard_after_forward
    assert tuned.train.log_every == 10 and tuned.exp == "fsdp4_tuned"
    # each lever is an override of its own
    assert compose_config(["+exp=fsdp4_tuned", "sharding.reshard_after_forward=true"]).sharding.reshard_after_forward


def test_fsdp4_fp8_is_the_tuned_run_with_float8_blocks_one_launch_adamw_and_graphs():
    tuned, fp8 = compose_config(["+exp=fsdp4_tuned"]), compose_config(["+exp=fsdp4_fp8"])
    for group in ("model", "data", "dist", "backend", "train"):
        assert fp8[group] == tuned[group], group
    # the graphs replay with the weights where they were recorded: FSDP2 gathers them into the same memory
    assert fp8.sharding == tuned.sharding and fp8.kernels == tuned.kernels
    assert (fp8.speed.name, tuned.speed.name) == ("graphs", "copies") and fp8.speed.keep_unsharded and not tuned.speed.keep_unsharded
    assert fp8.speed.cudagraphs and not tuned.speed.cudagraphs
    assert {**fp8.speed, "name": "copies", "keep_unsharded": False, "cudagraphs": False} == {**tuned.speed}
    assert not compose_config(["+exp=fsdp4_fp8", "speed.cudagraphs=false"]).speed.cudagraphs
    p = fp8.precision
    assert (p.name, p.float8, p.fp8_impl, p.fp8_recipe) == ("fp8", True, "triton", "rowwise_with_gw_tensorwise")
    assert (p.param_dtype, p.reduce_dtype) == ("bfloat16", "bfloat16")
    assert fp8.optim.impl == "triton" and fp8.optim.lr == tuned.optim.lr and fp8.exp == "fsdp4_fp8"
    # the recipe is an override of its own
    assert compose_config(["+exp=fsdp4_fp8", "precision.fp8_recipe=rowwise_with_gw_hp"]).precision.fp8_recipe == "rowwise_with_gw_hp"


BAD_OVERRIDES = [
    (["precision=fp9"], "precision=fp9: no such option in group 'precision'; use one of: bf16, fp32"),
    (["model.dimm=3"], "model.dimm=3: unknown key 'model.dimm'; valid keys in model: vocab_size, dim,"),
    (["+model.dimm=3"], "model.dimm: unknown key in model; valid keys:"),
    (["model.dim=abc"], "model.dim=abc: Value 'abc' of type 'str' could not be converted to Integer; model.dim takes an integer"),
    (["train.steps=1.5"], "train.steps=1.5:"),
    (["backend=cuda"], "backend=cuda but no CUDA GPU is visible"),
    # the preset the user typed is named, not the backend it set (three presets deep for fsdp4_fp8)
    (["+exp=fsdp4_fp8"], "+exp=fsdp4_fp8 is a GPU preset (it sets backend=cuda) and no CUDA GPU is visible"),
    (["backend=vulkan"], "backend=vulkan cannot train; use it with task=infer"),
    (["backend=mps", "sharding=none", "dist.nproc=1"], "backend=mps but torch.backends.mps.is_available() is False"),
    (["model.dim=100", "model.n_heads=16"], "model.dim=100 is not divisible by model.n_heads=16"),
    (["sharding=hsdp", "dist.nproc=3"], "sharding.replicate=2 must divide the world size 3"),
    (["sharding=fsdp2_offload"], "sharding=fsdp2_offload offloads to host memory from a GPU; with backend=cpu use sharding=fsdp2"),
    (["sharding=none", "speed.keep_unsharded=true"], "speed.keep_unsharded=true keeps FSDP2's gathered parameters in the same memory between steps, and sharding=none does not use FSDP2; use sharding=fsdp2 or hsdp, or drop the override"),
    (["sharding=none", "speed.grad_upcast=on"], "speed.grad_upcast=on upcasts FSDP2's reduced bf16/fp16 gradients to the fp32 parameters' dtype with a vectorised Triton kernel, and sharding=none does not use FSDP2"),
    (["speed.cast_in_step=on", "speed.one_rank_copies=off"], "speed.cast_in_step=on writes the casts into the storage speed.one_rank_copies keeps, and speed.one_rank_copies=off; set speed.one_rank_copies=auto or on"),
    (["speed.cast_in_step=on"], "speed.cast_in_step=on is done by the Triton AdamW update, and optim.impl=auto; set optim.impl=triton"),
    (["sharding=none", "sharding.split_root=true"], "sharding.split_root=true shards the embedding and head apart, and sharding=none does not shard; use sharding=fsdp2 or hsdp"),
    # a retired setting is an unknown key, refused when the config is composed
    (["kernels.cpp_wrapper=true"], "kernels.cpp_wrapper=true: unknown key 'kernels.cpp_wrapper'; valid keys in kernels: compile,"),
    (["sharding.grad_upcast=torch"], "sharding.grad_upcast=torch: unknown key 'sharding.grad_upcast'; valid keys in sharding: strategy,"),
    (["speed.forward_prefetch=1"], "speed.forward_prefetch=1: unknown key 'speed.forward_prefetch'; valid keys in speed: grad_upcast,"),
    (["speed.symm_mem=true"], "speed.symm_mem=true: unknown key 'speed.symm_mem'; valid keys in speed:"),
    (["speed.gather_copy_in=on"], "speed.gather_copy_in=on: unknown key 'speed.gather_copy_in'; valid keys in speed:"),
    (["optim.in_backward=true"], "optim.in_backward=true: unknown key 'optim.in_backward'; valid keys in optim:"),
    (["kernels.attention=cudnn"], "kernels.attention=cudnn: unknown key 'kernels.attention'; valid keys in kernels:"),
    (["speed.cudagraphs=true"], "speed.cudagraphs=true replays the run's Inductor-compiled graphs, and kernels=eager (compile=False, compile_backend=inductor) compiles none with Inductor; add kernels=compile (or kernels=auto, which compiles where it measures a gain)"),
    (["kernels=compile", "speed.cudagraphs=true"], "speed.cudagraphs=true replays the compiled blocks from CUDA graphs, and backend=cpu has none; use backend=cuda or drop the override"),
    (["data=text", "data.text_path=/no/such/file.txt"], "data.text_path=/no/such/file.txt: no such file"),
    (["data=text", "data.text_path=/dev"], "data.text_path=/dev: not a regular file"),
    (["+exp=nope"], "exp=nope: no such option in group 'exp'; use one of: diagnose, edge, fsdp4, fsdp4_fp8, fsdp4_tuned, kernels, kernels_cpu, llama3_1b, llama3_1b_fp8, profile"),
    # issue 14: each of these used to fail inside a rank, or train nonsense, or make folders
    (["optim.lr=-1"], "optim.lr=-1.0: must be a positive finite learning rate"),
    (["kernels.loss_trial=-1"], "kernels.loss_trial=-1: must be 0 (no trial) or more pairs of steps"),
    (["kernels.loss_trial=2"], "kernels.loss_trial=2 tries kernels=auto's fused loss, and kernels=eager picks none; use kernels=auto or kernels.loss_trial=0"),
    (["optim.lr=nan"], "optim.lr=nan: must be a positive finite learning rate"),
    (["optim.betas=[0.9,1.5]"], "optim.betas=[0.9, 1.5]: must be two numbers in [0, 1)"),
    (["data=random", "model.vocab_size=1"], "model.vocab_size=1: must be at least 2 tokens"),
    (["model=base_model"], "model=base_model: no such option in group 'model'; use one of: " + MODELS),
    (["sharding=base_sharding"], "sharding=base_sharding: no such option"),
    (["sharding.strategy=fsdp"], "sharding.strategy=fsdp: not a choice of sharding.strategy; use one of: fsdp2, hsdp, none"),
    (["speed.grad_upcast=triton"], "speed.grad_upcast=triton: not a choice of speed.grad_upcast; use one of: auto, on, off"),
    (["speed.one_rank_copies=skip"], "speed.one_rank_copies=skip: not a choice of speed.one_rank_copies; use one of: auto, on, off"),
    (["speed=fast"], "speed=fast: no such option in group 'speed'; use one of: copies, graphs, torch"),
    (["model.mlp=gelu"], "model.mlp=gelu: not a choice of model.mlp; use one of: silu, swiglu"),
    (["precision.param_dtype=fp8"], "precision.param_dtype=fp8: not a choice"),
    (["train.nonfinite=ignore"], "train.nonfinite=ignore: not a choice"),
    (["fault.kind=boom"], "fault.kind=boom: use one of none, raise, kill, nan"),
    (["fault.kind=raise", "fault.step=20"], "fault.step=20: must be a step of this run, 0 to 19"),
    (["exp=fsdp4"], "exp=fsdp4: 'exp' is not in the default list, so there is nothing to override; append it with +exp=fsdp4"),
    (["precision=fp32,bf16"], "precision=fp32,bf16: a list of values is a sweep: add -m"),
    (["model.dim=[1"], "model.dim=[1: cannot parse it"),
    (["+foo=1"], "foo: unknown top-level key"),
    (["+optim.lr_max=1"], "optim.lr_max: unknown key in optim"),
    (["tracking.uri=sqlite:////nonexistent_dir/x.db"], "tracking.uri=sqlite:////nonexistent_dir/x.db: no folder /nonexistent_dir for the database"),
    (["tracking.uri=mlruns"], "tracking.uri=mlruns: MLflow 3 takes a database or a server here"),
    (["hydra.run.dir=/proc/forbidden"], "hydra.run.dir=/proc/forbidden: cannot create the run's folder under /proc"),
]


@pytest.mark.parametrize("overrides,message", BAD_OVERRIDES, ids=[" ".join(o) for o, _ in BAD_OVERRIDES])
def test_bad_settings_fail_in_preflight_with_one_line(overrides, message):
    with pytest.raises(ConfigError) as err:
        preflight(overrides, multirun=False)
    assert message in str(err.value)
    assert "\n" not in str(err.value)


def test_a_text_file_too_short_to_read_a_window_from_is_refused(tmp_path: Path):
    empty, short = tmp_path / "empty.txt", tmp_path / "short.txt"
    empty.write_bytes(b"")
    short.write_bytes(b"x" * 100)
    with pytest.raises(ConfigError, match=f"data.text_path={empty}: the file is empty; data.seq_len=128 needs at least 130 bytes"):
        preflight(["data=text", f"data.text_path={empty}"], multirun=False)
    with pytest.raises(ConfigError, match="holds 100 bytes; data.seq_len=128 needs at least 130 bytes: give a longer file or lower data.seq_len"):
        preflight(["data=text", f"data.text_path={short}"], multirun=False)
    preflight(["data=text", f"data.text_path={short}", "data.seq_len=64"], multirun=False)


def test_help_lists_groups_and_every_option_with_its_docstring(workdir: Path):
    proc = run_cli(["--help", "hydra/help=all", "optim.schedule=cosine"], cwd=workdir, timeout=120)
    assert proc.returncode == 0 and "model: " + MODELS in " ".join(proc.stdout.split())  # wrapped at 100 columns
    assert "base_" not in proc.stdout  # schemas are not offered as options
    lines = proc.stdout.splitlines()
    # the composed values (tiny's width, the override) beside each field's docstring from src/config/schema.py
    assert any(line.startswith("  model.dim=64 ") and "model width" in line for line in lines)
    assert any(line.startswith("  optim.schedule=cosine ") for line in lines)
    assert any(line.startswith("  train.untimed_steps=2 ") and "left out of the throughput" in line for line in lines)
    assert max(map(len, lines)) <= 100 and list(workdir.iterdir()) == []


def test_a_bad_value_inside_a_sweep_fails_the_whole_sweep_before_it_starts():
    with pytest.raises(ConfigError, match="precision=fp9: no such option"):
        preflight(["precision=fp32,fp9", "sharding=none,fsdp2"], multirun=True)


def test_more_ranks_than_gpus_names_the_count():
    cfg = compose_config(["backend=cuda", "dist.nproc=4"])
    with pytest.raises(ConfigError, match=r"dist.nproc=4 but only 2 GPU\(s\) are present; set dist.nproc=2 or less"):
        validate(cfg, cuda_device_count=2, mps_available=False)
    validate(cfg, cuda_device_count=4, mps_available=False)
    # under torchrun the launcher, not us, decided how many ranks run on the node
    validate(cfg, cuda_device_count=2, mps_available=False, as_worker=True)


def test_cuda_graphs_under_fsdp2_need_the_gathered_weights_kept():
    """FSDP2 gathers the weights into new memory each step, and a graph replays with the addresses it
    recorded: 252 ms a step against 60 launched on an H200, so it is refused with the fix."""
    cfg = compose_config(["+exp=fsdp4_tuned", "dist.nproc=2", "speed.cudagraphs=true"])
    with pytest.raises(ConfigError, match="sharding=fsdp2 gathers the weights into new memory every step; add speed.keep_unsharded=true"):
        validate(cfg, cuda_device_count=2, mps_available=False)
    validate(compose_config(["+exp=fsdp4_tuned", "dist.nproc=2", "speed.cudagraphs=true", "speed.keep_unsharded=true"]),
             cuda_device_count=2, mps_available=False)
    # without FSDP2 nothing is gathered: the parameters stay where they are
    validate(compose_config(["+exp=fsdp4_tuned", "dist.nproc=1", "sharding=none", "sharding.split_root=false", "speed.cudagraphs=true"]),
             cuda_device_count=1, mps_available=False)


def test_kernels_auto_takes_the_inductor_options_for_what_it_compiles():
    """kernels=auto may compile the blocks (always with float8): speed.cudagraphs and the other Inductor options
    apply to what it compiles, so `+exp=fsdp4_fp8 kernels=auto` composes, and FSDP2 still needs the weights kept."""
    fixture = str(Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json")
    h200 = {"cuda_device_count": 1, "mps_available": False, "cuda_capability": ((9, 0), "NVIDIA H200")}
    validate(compose_config(["+exp=fsdp4_fp8", "dist.nproc=1", "kernels=auto", f"kernels.diagnosis={fixture}"]), **h200)
    auto_graphs = ["+exp=fsdp4", "dist.nproc=1", "kernels=auto", f"kernels.diagnosis={fixture}", "speed.cudagraphs=true"]
    with pytest.raises(ConfigError, match="add speed.keep_unsharded=true"):
        validate(compose_config(auto_graphs), **h200)
    validate(compose_config([*auto_graphs, "speed.keep_unsharded=true"]), **h200)
    with pytest.raises(ConfigError, match="kernels=auto .compile=False, compile_backend=aot_eager. compiles none with Inductor; set kernels.compile_backend=inductor"):
        validate(compose_config([*auto_graphs, "speed.keep_unsharded=true", "kernels.compile_backend=aot_eager"]), **h200)


def test_mps_trains_on_one_device_only():
    cfg = compose_config(["backend=mps"])
    with pytest.raises(ConfigError, match="backend=mps trains on one device only"):
        validate(cfg, cuda_device_count=0, mps_available=True)


@pytest.mark.parametrize(
    "args,needle",
    [
        (["precision=fp9"], "precision=fp9"),
        (["model.dim=abc"], "model.dim=abc"),
        (["backend=cuda"], "backend=cuda"),
        (["-m", "precision=fp32,bf16", "model.dim=100", "model.n_heads=16"], "model.dim=100"),
        (["exp=fsdp4"], "append it with +exp=fsdp4"),
        (["hydra.run.dir=/proc/forbidden"], "hydra.run.dir=/proc/forbidden"),
        (["tracking.uri=sqlite:////nonexistent_dir/x.db"], "no folder /nonexistent_dir"),
    ],
)
def test_cli_exits_2_with_one_line_and_leaves_nothing_behind(workdir: Path, args, needle):
    proc = run_cli(args, cwd=workdir, timeout=120)
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and needle in lines[0], proc.stderr
    assert list(workdir.iterdir()) == []  # no outputs/, multirun/, mlflow.db or mlruns/
    assert not Path("/nonexistent_dir").exists()


def test_kernels_on_a_cpu_point_at_a_command_that_runs(monkeypatch):
    with pytest.raises(ConfigError, match=r"`TRITON_INTERPRET=1 python -m src\.run \+exp=kernels_cpu`"):
        validate(compose_config(["+exp=kernels"]), cuda_device_count=0, mps_available=False)
    with pytest.raises(ConfigError, match=r"\+exp=kernels_cpu"):
        validate(compose_config(["+exp=kernels", "backend=cpu"]), cuda_device_count=0, mps_available=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")  # interpreted, LLM sizes would take minutes a row
    with pytest.raises(ConfigError, match="minutes a row"):
        validate(compose_config(["+exp=kernels", "backend=cpu"]), cuda_device_count=0, mps_available=False)
    validate(compose_config(["+exp=kernels_cpu"]), cuda_device_count=0, mps_available=False)
