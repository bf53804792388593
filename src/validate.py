"""Settings that compose but cannot run: checked before any rank, run directory or MLflow run exists.

Each check raises ConfigError with one line: the bad value, then the fix.
"""
from __future__ import annotations

import math
import os
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

import torch
from omegaconf import DictConfig

from src.compose import ConfigError
from src.config import GROUPS, RunConfig
from src.fusion.registry import REGISTRY, selected_ops, triton_usable

TRAINING_TASKS = {"train", "profile"}
TRAINING_BACKENDS = {"cpu", "cuda", "mps"}


def _check_group_keys(cfg: DictConfig) -> None:
    # `+model.dimm=3` (or `+foo=1`, `+optim.lr_max=1`) appends a key that no schema knows; it would
    # surface much later as a constructor error, or be ignored without a word, so refuse it here.
    top = {f.name for f in fields(RunConfig)}
    extra = sorted(set(cfg.keys()) - top - {"hydra"})
    if extra:
        raise ConfigError(f"{extra[0]}: unknown top-level key; valid ones: {', '.join(sorted(top - {'extra'}))} (free-form tags go in +extra.NAME=VALUE)")
    sections = {f.name: f.default_factory() for f in fields(RunConfig) if is_dataclass(f.default_factory if f.default_factory is not MISSING else None)}
    sections.update({group: schema for group, schema in GROUPS.items()})
    for section, schema in sections.items():
        known = {f.name for f in fields(schema)}
        extra = sorted(set(cfg[section].keys()) - known)
        if extra:
            raise ConfigError(f"{section}.{extra[0]}: unknown key in {section}; valid keys: {', '.join(sorted(known - {'name'}))}")


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
    need(o.warmup_steps >= 0, "optim.warmup_steps", o.warmup_steps, "0 or more (learning-rate warm-up steps)")
    need(finite(o.min_lr_ratio) and 0 <= o.min_lr_ratio <= 1, "optim.min_lr_ratio", o.min_lr_ratio, "a fraction in [0, 1], e.g. optim.min_lr_ratio=0.1")
    need(cfg.dist.max_restarts >= 0, "dist.max_restarts", cfg.dist.max_restarts, "0 or more")
    need(cfg.dist.timeout_s >= 1, "dist.timeout_s", cfg.dist.timeout_s, "at least 1 second")
    need(finite(cfg.data.corpus_mb) and cfg.data.corpus_mb > 0, "data.corpus_mb", cfg.data.corpus_mb, "a positive size in MB, e.g. data.corpus_mb=4")
    tr = cfg.tracking
    need(finite(tr.system_metrics_interval_s) and tr.system_metrics_interval_s > 0, "tracking.system_metrics_interval_s", tr.system_metrics_interval_s, "a positive interval, e.g. 10")
    need(finite(tr.connect_timeout_s) and tr.connect_timeout_s > 0, "tracking.connect_timeout_s", tr.connect_timeout_s, "a positive timeout, e.g. 5")
    need(finite(tr.retry_s) and tr.retry_s >= 0, "tracking.retry_s", tr.retry_s, "0 (give up at once) or more seconds, e.g. 60")
    f, world = cfg.fault, cfg.dist.nproc * cfg.dist.nnodes
    if f.kind != "none":
        need(0 <= f.rank < world, "fault.rank", f.rank, f"a rank of this run, 0 to {world - 1}")
        need(0 <= f.step < t.steps, "fault.step", f.step, f"a step of this run, 0 to {t.steps - 1} (steps count from 0)")


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


def _check_tracking_uri(cfg: DictConfig) -> None:
    """A sqlite store in a folder that does not exist: MLflow would create the folder (anywhere,
    `/nonexistent_dir/` at the filesystem root included) without a word."""
    uri = cfg.tracking.uri
    if not cfg.tracking.enabled:
        return
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        folder = (db if db.is_absolute() else Path(os.getcwd()) / db).parent
        if not folder.is_dir():
            raise ConfigError(f"tracking.uri={uri}: no folder {folder} for the database; create it first, or use tracking.uri=sqlite:///mlflow.db (here)")
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"tracking.uri={uri}: cannot write in {folder}; use tracking.uri=sqlite:///mlflow.db (here) or a writable folder")
    elif not uri.startswith(("http://", "https://", "databricks", "postgresql", "mysql", "mssql")):
        raise ConfigError(f"tracking.uri={uri}: MLflow 3 takes a database or a server here: sqlite:///mlflow.db, or http://HOST:PORT of `mlflow server`")


IREE_INSTALL = "pip install iree-base-compiler iree-base-runtime iree-turbine"


def _check_infer(cfg: DictConfig, backend: str, cuda_device_count: int, mps_available: bool) -> None:
    from src.edge.targets import BACKEND_DTYPES, METAL_PLATFORMS, known_targets, vulkan_target
    from src.edge.task import default_target

    e = cfg.edge
    if e.action not in ("bench", "compile", "run"):
        raise ConfigError(f"edge.action={e.action}: bench (compile if needed, then time here), compile (artifacts for another device) or run (time artifacts)")
    if backend not in ("vulkan", "mps", "cpu", "cuda"):
        raise ConfigError(f"task=infer runs on backend=vulkan, mps, cpu or cuda, not {backend}")
    if e.action == "compile" and backend not in ("vulkan", "mps"):
        raise ConfigError(f"edge.action=compile makes IREE modules for backend=vulkan or backend=mps (Metal); backend={backend} runs torch directly: use edge.action=bench")
    if e.action == "run" and backend != "vulkan":
        raise ConfigError(f"edge.action=run times Vulkan artifacts (backend=vulkan); backend={backend} has none to run")
    if min(e.batch, e.prompt_len, e.decode_steps, e.repeats) < 1 or e.warmup < 0:
        raise ConfigError("edge.batch, prompt_len, decode_steps and repeats must be at least 1 (warmup 0 or more)")
    if e.max_seq and e.max_seq < e.prompt_len + e.decode_steps:
        raise ConfigError(f"edge.max_seq={e.max_seq} holds fewer positions than prompt_len + decode_steps = {e.prompt_len + e.decode_steps}; raise it or leave it 0")
    if e.dtype not in ("fp32", "fp16", "bf16"):
        raise ConfigError(f"edge.dtype={e.dtype}: fp32, fp16 or bf16")
    if e.weights and not os.path.isfile(e.weights):
        raise ConfigError(f"edge.weights={e.weights}: no such file; export one with `python -m src.export CHECKPOINT --out model.safetensors`")
    target = default_target(backend, e.target)
    if backend == "mps":
        if e.action == "compile":
            if target not in METAL_PLATFORMS:
                raise ConfigError(f"edge.target={target}: Metal compiles for {', '.join(METAL_PLATFORMS)}")
        elif not mps_available:
            raise ConfigError("backend=mps needs Apple Silicon (torch.backends.mps.is_available() is False here); "
                              "to prepare Metal code here, use edge.action=compile (MSL source)")
        elif e.dtype not in BACKEND_DTYPES["mps"]:
            raise ConfigError(f"edge.dtype={e.dtype}: MPS computes in {', '.join(BACKEND_DTYPES['mps'])}")
    if backend == "cuda" and cuda_device_count == 0:
        raise ConfigError("backend=cuda but no CUDA GPU is visible; use backend=cpu or backend=vulkan")
    if backend == "vulkan" or (backend == "mps" and e.action == "compile"):
        try:
            import iree.runtime  # noqa: F401
            if e.action != "run":
                import iree.compiler  # noqa: F401
                import iree.turbine  # noqa: F401
        except ImportError:
            raise ConfigError(f"backend={backend} goes through IREE, which is not installed: {IREE_INSTALL}") from None
    if backend == "vulkan":
        if e.action == "run":
            manifest = os.path.join(e.artifacts, "manifest.json")
            if not e.artifacts or not os.path.isfile(manifest):
                raise ConfigError(f"edge.artifacts={e.artifacts or '(empty)'}: no manifest.json there; make the artifacts with edge.action=compile")
        else:
            spec = vulkan_target(target)
            if spec is None:
                raise ConfigError(f"edge.target={target}: not a Vulkan target IREE knows; use one of {known_targets()}")
            if e.dtype not in spec.dtypes:
                raise ConfigError(f"edge.dtype={e.dtype}: Vulkan target {target} computes in {' or '.join(spec.dtypes)}; use edge.dtype={spec.dtypes[-1]} or fp32")
        if e.action != "compile":
            from src.edge.runtime import vulkan_devices

            if not vulkan_devices():
                raise ConfigError("backend=vulkan: no Vulkan driver found; install one: `apt-get install mesa-vulkan-drivers` "
                                  "(lavapipe, runs on the CPU) or the GPU vendor's driver")


KERNELS_ON_CPU = "TRITON_INTERPRET=1 python -m src.run +exp=kernels_cpu"
_INTERPRETER_MAX_ELEMENTS = 1 << 20  # a [64, 256] row takes ~1 s in the interpreter; [8192, 4096] ~90 s


def _check_kernel_bench(cfg: DictConfig, backend: str, cuda_device_count: int) -> None:
    from src.dtypes import TORCH_DTYPES
    from src.kernel_bench.cases import OPS

    b = cfg.kernel_bench
    if backend not in ("cpu", "cuda"):
        raise ConfigError(f"task=kernel_bench times kernels on backend=cuda (or backend=cpu to check the plumbing), not backend={backend}")
    if backend == "cuda" and cuda_device_count == 0:
        raise ConfigError(f"backend=cuda but no CUDA GPU is visible; +exp=kernels times kernels on an NVIDIA GPU; on a CPU, check the plumbing with `{KERNELS_ON_CPU}`")
    for name, given, allowed in (("ops", b.ops, OPS), ("providers", b.providers, ("eager", "compile", "triton", "liger")), ("modes", b.modes, ("fwd", "fwd_bwd"))):
        unknown = [v for v in given if v not in allowed]
        if unknown or not given:
            raise ConfigError(f"kernel_bench.{name}={list(given)}: {'unknown ' + ', '.join(unknown) if unknown else 'empty'}; choose from {', '.join(allowed)}")
    if b.dtype not in TORCH_DTYPES:
        raise ConfigError(f"kernel_bench.dtype={b.dtype}: one of {', '.join(TORCH_DTYPES)}")
    for op in b.ops:
        want = 3 if op == "linear_cross_entropy" else 2
        shapes = b.shapes.get(op)
        if not shapes or any(len(s) != want or min(s) < 1 for s in shapes):
            form = "[tokens, dim, vocab]" if want == 3 else "[rows, width]"
            raise ConfigError(f"kernel_bench.shapes.{op}={None if shapes is None else [list(s) for s in shapes]}: give a list of {form} with positive sizes")
    if "triton" in b.providers:
        why_not = triton_usable(backend)
        if why_not and backend == "cpu":
            raise ConfigError(f"kernel_bench.providers has triton, which runs on a CPU only in Triton's interpreter: `{KERNELS_ON_CPU}`")
        if why_not:
            raise ConfigError(f"kernel_bench.providers has triton: {why_not}; or drop it from kernel_bench.providers")
        largest = max(math.prod(s) for op in b.ops for s in b.shapes[op])
        if backend == "cpu" and largest > _INTERPRETER_MAX_ELEMENTS:
            raise ConfigError(f"kernel_bench.shapes at these sizes take minutes a row in Triton's interpreter "
                              f"(LLM sizes: 2 rows in 180 s); use the small sizes of `{KERNELS_ON_CPU}`")


def _lowest_capability(cuda_device_count: int) -> tuple[tuple[int, int] | None, str]:
    """The lowest compute capability among the visible GPUs and that GPU's name; probed only for
    precision=fp8, the one setting that needs it."""
    if cuda_device_count == 0:
        return None, ""
    caps = sorted((torch.cuda.get_device_capability(i), i) for i in range(cuda_device_count))
    return caps[0][0], torch.cuda.get_device_name(caps[0][1])


COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")


def validate(cfg: DictConfig, cuda_device_count: int | None = None, mps_available: bool | None = None, as_worker: bool = False,
             cuda_capability: tuple[tuple[int, int] | None, str] | None = None) -> None:
    """Raise ConfigError for the first impossible combination. Device facts are probed unless given
    (tests pass them to check the messages for hardware this machine lacks): `cuda_capability` is
    (the lowest compute capability of the visible GPUs, that GPU's name)."""
    _check_group_keys(cfg)
    _check_tracking_uri(cfg)
    backend, task, sharding = cfg.backend.name, cfg.task.name, cfg.sharding
    nproc = cfg.dist.nproc
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if mps_available is None:
        mps_available = torch.backends.mps.is_available()

    if task in TRAINING_TASKS and backend not in TRAINING_BACKENDS:
        raise ConfigError(f"backend={backend} cannot train; use it with task=infer (+exp=edge), or train with backend=cpu or backend=cuda")
    if task == "infer":  # one process, one device: none of the training checks apply
        _check_infer(cfg, backend, cuda_device_count, mps_available)
        return
    if task == "kernel_bench":  # one process, one device: none of the training checks apply
        _check_kernel_bench(cfg, backend, cuda_device_count)
        return
    if task == "diagnose" and cfg.diagnose.report:  # diagnosing a report runs nothing on a device
        if not os.path.isfile(cfg.diagnose.report):
            raise ConfigError(f"diagnose.report={cfg.diagnose.report}: no such file; give an .ncu-rep or its --csv --page raw export")
        return
    if task == "diagnose" and (backend != "cuda" or cuda_device_count == 0):
        from src.diagnose.task import NO_GPU

        raise ConfigError(NO_GPU)
    if cfg.profile.nvtx and backend != "cuda":
        raise ConfigError(f"profile.nvtx=true marks ranges for Nsight tools on an NVIDIA GPU; with backend={backend} use +exp=profile (torch.profiler)")
    if backend == "cuda" and cuda_device_count == 0:
        raise ConfigError("backend=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False); use backend=cpu, or run on a machine with an NVIDIA GPU")
    if backend == "mps" and not mps_available:
        raise ConfigError("backend=mps but torch.backends.mps.is_available() is False (MPS needs Apple Silicon and macOS 12.3+); use backend=cpu")
    if task in TRAINING_TASKS and backend == "mps" and (sharding.strategy != "none" or nproc != 1):
        raise ConfigError(f"backend=mps trains on one device only (sharding={sharding.name}, dist.nproc={nproc}); use sharding=none dist.nproc=1")
    if nproc < 1 or cfg.dist.nnodes < 1:
        raise ConfigError(f"dist.nproc={nproc} dist.nnodes={cfg.dist.nnodes}: both must be at least 1")
    if backend == "cuda" and not as_worker and nproc > cuda_device_count:
        raise ConfigError(f"dist.nproc={nproc} but only {cuda_device_count} GPU(s) are present; set dist.nproc={cuda_device_count} or less")

    if cfg.precision.float8 and task in TRAINING_TASKS:
        from src.distributed.float8 import float8_dims, float8_refusal

        capability, device_name = cuda_capability or _lowest_capability(cuda_device_count if backend == "cuda" else 0)
        why_not = float8_refusal(backend, capability, device_name, float8_dims(cfg.model, cfg.data))
        if why_not:
            raise ConfigError(why_not)
    if cfg.kernels.compile_backend not in COMPILE_BACKENDS:
        raise ConfigError(f"kernels.compile_backend={cfg.kernels.compile_backend}: one of {', '.join(COMPILE_BACKENDS)} (inductor generates the kernels)")

    fused = selected_ops(cfg.kernels.fused)
    if cfg.kernels.auto:
        from src.fusion.choice import auto_choice

        fused = list(auto_choice(cfg, os.getcwd()).ops)
    if fused:
        why_not = triton_usable(backend)
        if why_not:
            raise ConfigError(f"kernels={cfg.kernels.name}: {why_not}; or use kernels=eager")
        unknown = [op for op in fused if op not in REGISTRY]
        if unknown:
            raise ConfigError(f"kernels.fused={unknown}: no fused Triton variant; there are: {', '.join(REGISTRY)}")
        if "rms_norm" in fused and cfg.model.dim > REGISTRY["rms_norm"].max_dim:
            raise ConfigError(f"model.dim={cfg.model.dim}: the fused RMSNorm holds a row in registers, at most {REGISTRY['rms_norm'].max_dim}")
    from src.fusion.compiled import COMPILABLE

    not_compilable = [op for op in cfg.kernels.compiled if op not in COMPILABLE]
    if not_compilable:
        raise ConfigError(f"kernels.compiled={not_compilable}: no compiled variant of that op; there are: {', '.join(COMPILABLE)}")
    m = cfg.model
    if m.dim % m.n_heads:
        raise ConfigError(f"model.dim={m.dim} is not divisible by model.n_heads={m.n_heads}; pick a dim that is a multiple of {m.n_heads}, or another n_heads")
    if m.mlp not in ("silu", "swiglu"):
        raise ConfigError(f"model.mlp={m.mlp}: use silu (the seed's MLP) or swiglu (LLaMA's gated MLP)")
    if min(m.dim, m.n_layers, m.n_heads, m.vocab_size, m.ffn_mult) < 1 or m.ffn_hidden < 0:
        raise ConfigError("model.dim, n_layers, n_heads, vocab_size and ffn_mult must all be positive (ffn_hidden 0 or more)")
    if cfg.data.source == "text":
        _check_text_file(cfg)
    if not 0.0 <= cfg.train.label_smoothing < 1.0:
        raise ConfigError(f"train.label_smoothing={cfg.train.label_smoothing}: a fraction in [0, 1), e.g. 0.1")
    if cfg.train.nonfinite not in ("fail", "skip"):
        raise ConfigError(f"train.nonfinite={cfg.train.nonfinite}: use fail or skip")
    ck = cfg.checkpoint
    if ck.resume not in ("auto", "none"):
        from src.train.checkpoint import CheckpointError, checkpoint_step

        try:
            checkpoint_step(Path(ck.resume))
        except CheckpointError as err:
            raise ConfigError(str(err)) from None
    if ck.interval < 0 or ck.keep_last < 1:
        raise ConfigError(f"checkpoint.interval={ck.interval} checkpoint.keep_last={ck.keep_last}: interval >= 0, keep_last >= 1")
    if cfg.fault.kind not in ("none", "raise", "kill", "nan"):
        raise ConfigError(f"fault.kind={cfg.fault.kind}: use one of none, raise, kill, nan")
    if cfg.data.source == "text" and m.vocab_size < 256:
        raise ConfigError(f"data=text is byte-level and needs model.vocab_size >= 256 (got {m.vocab_size})")
    if cfg.data.batch_size < 1 or cfg.data.seq_len < 1:
        raise ConfigError(f"data.batch_size={cfg.data.batch_size} data.seq_len={cfg.data.seq_len}: both must be at least 1")

    world = nproc * cfg.dist.nnodes
    if sharding.strategy == "hsdp":
        if sharding.replicate < 1 or world % sharding.replicate:
            raise ConfigError(f"sharding.replicate={sharding.replicate} must divide the world size {world} for hsdp; set dist.nproc to a multiple of it")
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
