"""The training tasks' own settings checks (train, profile, and diagnose, which trains one step):
src/config/validate.py runs them after the cross-group rules. Each raises ConfigError with the bad value
and the fix."""
from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import torch
from omegaconf import DictConfig

from src.config.compose import ConfigError
from src.distributed.float8 import gathers_float8
from src.fusion.registry import REGISTRY, interpreted, selected_ops, triton_usable
from src.models.checks import model_refusal
from src.runtime import world_size

TRAINING_TASKS = {"train", "profile"}
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def _check_numbers(cfg: DictConfig) -> None:
    """Numbers that compose (right type) but would fail inside a rank, or train nonsense silently:
    `optim.lr=-1` is AdamW's ValueError on every rank, `model.vocab_size=1` trains to loss 0."""
    o, t, m = cfg.optim, cfg.train, cfg.model

    def need(ok: bool, key: str, value, want: str) -> None:
        if not ok:
            raise ConfigError(f"{key}={value}: must be {want}")

    finite = math.isfinite
    need(finite(o.lr) and o.lr > 0, "optim.lr", o.lr, "a positive finite learning rate, e.g. optim.lr=3e-4")
    need(finite(o.eps) and o.eps > 0, "optim.eps", o.eps, "a small positive number, e.g. optim.eps=1e-8")
    need(finite(o.weight_decay) and o.weight_decay >= 0, "optim.weight_decay", o.weight_decay, "0 or more, e.g. optim.weight_decay=0.01")
    need(finite(o.grad_clip) and o.grad_clip >= 0, "optim.grad_clip", o.grad_clip, "0 (no clipping) or a positive norm, e.g. optim.grad_clip=1.0")
    need(len(o.betas) == 2 and all(finite(b) and 0 <= b < 1 for b in o.betas), "optim.betas", list(o.betas), "two numbers in [0, 1), e.g. optim.betas=[0.9,0.999]")
    # One token has nothing to predict: cross-entropy is 0 from the first step and the run "succeeds".
    need(m.vocab_size >= 2, "model.vocab_size", m.vocab_size, "at least 2 tokens (256 for the byte-level data=text)")
    need(finite(m.norm_eps) and m.norm_eps > 0, "model.norm_eps", m.norm_eps, "a small positive number, e.g. model.norm_eps=1e-6")
    need(finite(m.init_std) and m.init_std > 0, "model.init_std", m.init_std, "a positive standard deviation, e.g. model.init_std=0.02")
    need(t.log_every >= 1, "train.log_every", t.log_every, "at least 1 (log every Nth step)")
    need(t.untimed_steps >= 0, "train.untimed_steps", t.untimed_steps, "0 or more")
    need(t.gpu_clock_interval_s >= 0, "train.gpu_clock_interval_s", t.gpu_clock_interval_s, "0 (off) or more seconds")
    need(cfg.kernels.loss_trial >= 0, "kernels.loss_trial", cfg.kernels.loss_trial, "0 (no trial) or more pairs of steps, e.g. kernels.loss_trial=2")
    if cfg.kernels.loss_trial and not cfg.kernels.auto:
        raise ConfigError(f"kernels.loss_trial={cfg.kernels.loss_trial} tries kernels=auto's fused loss, and kernels={cfg.kernels.name} picks none; "
                          "use kernels=auto or kernels.loss_trial=0")
    need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "0 or more (learning-rate warm-up steps)")
    need(finite(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "a fraction in [0, 1], e.g. optim.min_lr_ratio=0.1")
    need(cfg.dist.max_restarts >= 0, "dist.max_restarts", cfg.dist.max_restarts, "0 or more")
    need(cfg.dist.timeout_s >= 1, "dist.timeout_s", cfg.dist.timeout_s, "at least 1 second")
    need(finite(cfg.data.corpus_mb) and cfg.data.corpus_mb > 0, "data.corpus_mb", cfg.data.corpus_mb, "a positive size in MB, e.g. data.corpus_mb=4")
    tr = cfg.tracking
    need(finite(tr.system_metrics_interval_s) and tr.system_metrics_interval_s > 0, "tracking.system_metrics_interval_s", tr.system_metrics_interval_s, "a positive interval, e.g. 10")
    need(finite(tr.connect_timeout_s) and tr.connect_timeout_s > 0, "tracking.connect_timeout_s", tr.connect_timeout_s, "a positive timeout, e.g. 5")
    need(finite(tr.retry_s) and tr.retry_s >= 0, "tracking.retry_s", tr.retry_s, "0 (give up at once) or more seconds, e.g. 60")
    f, world = cfg.fault, world_size(cfg)
    if f.kind != "none":
        need(0 <= f.rank < world, "fault.rank", f.rank, f"a rank of this run, 0 to {world - 1}")
        need(0 <= f.step < t.steps, "fault.step", f.step, f"a step of this run, 0 to {t.steps - 1} (steps count from 0)")


def _check_triton_optimizer(cfg: DictConfig, backend: str) -> None:
    why_not = triton_usable(backend)
    if why_not and (backend == "cuda" or interpreted()):
        raise ConfigError(f"optim.impl=triton: {why_not}; or use optim.impl={'fused' if backend == 'cuda' else 'foreach'}")
    if gathers_float8(cfg.precision, cfg.sharding.strategy):
        raise ConfigError(f"optim.impl=triton reads each parameter's storage, and precision={cfg.precision.name}'s float8-gathered weights are wrapper tensors "
                          "without one; use optim.impl=fused, or precision.fp8_all_gather=false")
    if cfg.sharding.cpu_offload:
        raise ConfigError(f"optim.impl=triton updates the parameters on the GPU, and sharding={cfg.sharding.name} keeps them in host memory; use optim.impl=foreach")
    if backend != "cuda" and not interpreted():
        raise ConfigError(f"optim.impl=triton runs a Triton kernel, which needs an NVIDIA GPU (backend=cuda); with backend={backend} use optim.impl=foreach "
                          "(or TRITON_INTERPRET=1 to run it in Triton's interpreter, slowly)")


def _check_speed(cfg: DictConfig, backend: str) -> None:
    """speed.*: the recipes asked for by name on this torch (src/speed/apply.py), and the levers' own needs."""
    from src.speed.apply import refusal

    speed, sharding = cfg.speed, cfg.sharding
    why_not = refusal(cfg)
    if why_not:
        raise ConfigError(why_not)
    compiles = cfg.kernels.compile or cfg.kernels.auto  # kernels=auto may compile the blocks or single ops
    if speed.cudagraphs and not (compiles and cfg.kernels.compile_backend == "inductor"):
        fix = "set kernels.compile_backend=inductor" if compiles else "add kernels=compile (or kernels=auto, which compiles where it measures a gain)"
        raise ConfigError(f"speed.cudagraphs=true replays the run's Inductor-compiled graphs, and kernels={cfg.kernels.name} "
                          f"(compile={cfg.kernels.compile}, compile_backend={cfg.kernels.compile_backend}) compiles none with Inductor; {fix}")
    if speed.cudagraphs and backend != "cuda":
        raise ConfigError(f"speed.cudagraphs=true replays the compiled blocks from CUDA graphs, and backend={backend} has none; "
                          "use backend=cuda or drop the override")
    if speed.cudagraphs and sharding.strategy in ("fsdp2", "hsdp") and not speed.keep_unsharded:
        # FSDP2 frees the gathered weights after each step and gathers them into new memory: each new
        # address records the blocks' graphs again
        raise ConfigError(f"speed.cudagraphs=true replays the compiled blocks with their weights where they were recorded, and "
                          f"sharding={sharding.name} gathers the weights into new memory every step; add speed.keep_unsharded=true (or use speed=graphs)")


_SAID: set = set()


def _say_once(key) -> bool:
    """True the first time `key` is seen in this process: validate runs again where the job runs."""
    if key in _SAID:
        return False
    _SAID.add(key)
    return True


def _check_text_file(cfg: DictConfig) -> None:
    path = cfg.data.text_path
    if not path:
        return
    if not os.path.isfile(path):
        what = "not a regular file" if os.path.exists(path) else "no such file"
        raise ConfigError(f"data.text_path={path}: {what}; give a UTF-8 text file, or leave it empty for the built-in corpus")
    # A batch reads windows of seq_len + 1 bytes from random offsets: a shorter file has none.
    size, need = os.path.getsize(path), cfg.data.seq_len + 2
    if size < need:
        what = "is empty" if size == 0 else f"holds {size} bytes"
        raise ConfigError(f"data.text_path={path}: the file {what}; data.seq_len={cfg.data.seq_len} needs at least {need} bytes: give a longer file or lower data.seq_len")
    with open(path, "rb") as f:
        head = f.read(65536)
    if b"\0" in head and _say_once(("binary", path)):
        sys.stderr.write(f"warning: data.text_path={path} holds NUL bytes: a binary file, not text; the byte-level model trains on its bytes\n")


def _check_tokens(cfg: DictConfig) -> None:
    """data=tokens: a prepared folder whose vocabulary the model holds and whose shards hold a window."""
    from src.data.tokens import TokenDataError, TokenShards, max_token_id

    path = cfg.data.tokens_path
    if not path:
        raise ConfigError("data=tokens reads a corpus python -m src.data.prepare made: set data.tokens_path=DIR")
    try:
        shards = TokenShards(Path(path), cfg.data.seq_len + 1)
    except TokenDataError as err:
        raise ConfigError(str(err)) from None
    top = max_token_id(shards.meta)
    if top is not None and top >= cfg.model.vocab_size:
        raise ConfigError(f"data.tokens_path={path} holds token ids up to {top} (meta.json's max_ids), and model.vocab_size={cfg.model.vocab_size}: "
                          f"set model.vocab_size={top + 1} or more")
    vocab = shards.meta["vocab_size"]
    if vocab > cfg.model.vocab_size:
        raise ConfigError(f"data.tokens_path={path} holds token ids up to {vocab - 1} (its tokenizer's vocabulary, {vocab}), "
                          f"and model.vocab_size={cfg.model.vocab_size}: set model.vocab_size={vocab} or more")


def _lowest_capability(cuda_device_count: int) -> tuple[tuple[int, int] | None, str]:
    """The lowest compute capability among the visible GPUs and that GPU's name; probed only for
    precision=fp8, the one setting that needs it."""
    if cuda_device_count == 0:
        return None, ""
    caps = sorted((torch.cuda.get_device_capability(i), i) for i in range(cuda_device_count))
    return caps[0][0], torch.cuda.get_device_name(caps[0][1])


def check_training(cfg: DictConfig, cuda_device_count: int, cuda_capability: tuple[tuple[int, int] | None, str] | None = None) -> None:
    """Everything a training step needs of its own groups: float8, kernels, model, data, checkpoint,
    fault, sharding shape, numbers, the profiler's schedule."""
    backend, task, sharding = cfg.backend.name, cfg.task.name, cfg.sharding
    if cfg.precision.float8 and task in TRAINING_TASKS:
        from src.distributed.float8 import act_in_cast_refusal, float8_dims, float8_refusal

        why_not = act_in_cast_refusal(cfg.precision, cfg.model.mlp)
        if why_not:
            raise ConfigError(why_not)

        capability, device_name = cuda_capability or _lowest_capability(cuda_device_count if backend == "cuda" else 0)
        why_not = float8_refusal(backend, capability, device_name, float8_dims(cfg.model, cfg.data), str(cfg.precision.fp8_impl), str(cfg.precision.fp8_recipe))
        if why_not:
            raise ConfigError(why_not)
    if cfg.kernels.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"kernels.compile_backend={cfg.kernels.compile_backend}: one of {', '.join(COMPILE_BACKENDS)} (inductor generates the kernels)")
    fused = selected_ops(cfg.kernels.fused)
    if cfg.kernels.auto:
        from src.fusion.choice import auto_choice, with_float8_head

        fused = with_float8_head(cfg, [op for op in auto_choice(cfg, os.getcwd()).ops if op in REGISTRY])  # AdamW's pick is optim.impl, checked with it
    if fused:
        unknown = [op for op in fused if op not in REGISTRY]  # a misspelt op first: the same line on every machine
        if unknown:
            raise ConfigError(f"kernels.fused={unknown}: no fused Triton variant; there are: {', '.join(REGISTRY)}")
        why_not = triton_usable(backend)
        if why_not:
            if cfg.kernels.fused is not None and not cfg.kernels.auto:
                # a list, perhaps from an experiment (+exp=fsdp4_tuned fuses the loss) under another kernels choice
                raise ConfigError(f"kernels.fused=[{','.join(fused)}] (kernels={cfg.kernels.name}): {why_not}; or set kernels.fused=[]")
            # kernels=triton (every fused op) or auto's picks
            fix = "set kernels.fused=[]" if cfg.kernels.name == "eager" else "use kernels=eager"
            raise ConfigError(f"kernels={cfg.kernels.name}: {why_not}; or {fix}")
        if "rms_norm" in fused and cfg.model.dim > REGISTRY["rms_norm"].max_dim:
            raise ConfigError(f"model.dim={cfg.model.dim}: the fused RMSNorm holds a row in registers, at most {REGISTRY['rms_norm'].max_dim}")
    if cfg.precision.fp8_head and task in TRAINING_TASKS:
        from src.distributed.float8 import head_refusal

        why_not = head_refusal(cfg.precision, fused, cfg.model)
        if why_not:
            raise ConfigError(why_not)
    from src.fusion.compiled import COMPILABLE

    not_compilable = [op for op in cfg.kernels.compiled if op not in COMPILABLE]
    if not_compilable:
        raise ConfigError(f"kernels.compiled={not_compilable}: no compiled variant of that op; there are: {', '.join(COMPILABLE)}")
    m = cfg.model
    why_not = model_refusal(m)
    if why_not:
        raise ConfigError(why_not)
    if m.get("tie_embeddings", False) and sharding.split_root:
        raise ConfigError(f"sharding.split_root=true puts the embedding and the head in FSDP2 units of their own, and model={m.name} ties them "
                          "(one weight): set sharding.split_root=false")
    if cfg.data.source == "text":
        _check_text_file(cfg)
    if cfg.data.source == "tokens":
        _check_tokens(cfg)
    if not 0.0 <= cfg.train.label_smoothing < 1.0:
        raise ConfigError(f"train.label_smoothing={cfg.train.label_smoothing}: a fraction in [0, 1), e.g. 0.1")
    if cfg.train.nonfinite not in ("fail", "skip"):
        raise ConfigError(f"train.nonfinite={cfg.train.nonfinite}: use fail or skip")
    ck = cfg.checkpoint
    if ck.resume not in ("auto", "none"):
        from src.train.resume_check import resume_target

        resume_target(cfg, None)  # a complete checkpoint, or one line naming the newest complete one near it
    if ck.interval < 0 or ck.keep_last < 1:
        raise ConfigError(f"checkpoint.interval={ck.interval} checkpoint.keep_last={ck.keep_last}: interval >= 0, keep_last >= 1")
    if cfg.fault.kind not in ("none", "raise", "kill", "nan"):
        raise ConfigError(f"fault.kind={cfg.fault.kind}: use one of none, raise, kill, nan")
    if cfg.data.source == "text" and m.vocab_size < 256:
        raise ConfigError(f"data=text is byte-level and needs model.vocab_size >= 256 (got {m.vocab_size})")
    if cfg.data.batch_size < 1 or cfg.data.seq_len < 1:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} data.seq_len={cfg.data.seq_len}: both must be at least 1")

    world = world_size(cfg)
    if sharding.strategy == "hsdp":
        if sharding.replicate < 1 or world % sharding.replicate:
            raise ConfigError(f"sharding.replicate={sharding.replicate} must divide the world size {world} for hsdp; set dist.nproc to a multiple of it")
    if sharding.split_root and sharding.strategy not in ("fsdp2", "hsdp"):
        raise ConfigError(f"sharding.split_root=true shards the embedding and head apart, and sharding={sharding.name} does not shard; use sharding=fsdp2 or hsdp")
    if cfg.ac.mode == "selective" and cfg.ac.selective != "op" and not (cfg.ac.selective.isdigit() and int(cfg.ac.selective) >= 1):
        raise ConfigError(f"ac.selective={cfg.ac.selective}: op (keep the matmuls' outputs, recompute the rest) or N >= 1 (every Nth block in full)")
    if cfg.optim.state_dtype != "float32" and cfg.optim.impl != "triton":
        raise ConfigError(f"optim.state_dtype={cfg.optim.state_dtype} keeps AdamW's moments in {cfg.optim.state_dtype}, which only the Triton update "
                          f"rounds stochastically; set optim.impl=triton (now {cfg.optim.impl}), or optim.state_dtype=float32")
    if cfg.optim.impl == "triton":
        _check_triton_optimizer(cfg, backend)
    _check_speed(cfg, backend)
    if sharding.cpu_offload and backend != "cuda":
        raise ConfigError(f"sharding={sharding.name} offloads to host memory from a GPU; with backend={backend} use sharding=fsdp2")
    if cfg.train.steps < 1:
        raise ConfigError(f"train.steps={cfg.train.steps} must be at least 1")
    _check_numbers(cfg)
    p = cfg.profile
    if task == "profile" and cfg.train.steps < p.wait + p.warmup + p.active:
        raise ConfigError(
            f"train.steps={cfg.train.steps} is shorter than the profiler schedule (wait {p.wait} + warmup {p.warmup} + active {p.active}); "
            f"set train.steps={p.wait + p.warmup + p.active} or more"
        )
