"""task=train on one rank: build the model on the meta device, shard it, materialise it, train, and
(rank 0 only) log to MLflow and write summary.json."""
from __future__ import annotations

import json
import logging
import os
import signal
import traceback
from dataclasses import replace
from functools import partial
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from src.data.batches import TokenBatches
from src.distributed.env import DistEnv, build_mesh, init_distributed, launched_as_worker, shutdown
from src.distributed.launch import ERROR_NOTE
from src.distributed.parallelize import apply_fsdp, materialize_and_init, mixed_precision_policy
from src.dtypes import torch_dtype
from src.fusion.registry import FusedModel, apply_fused, selected_ops
from src.models import build_model
from src.profiling.anatomy import metrics as anatomy_metrics
from src.profiling.annotate import module_ranges, profiled_step, step_marker
from src.profiling.torch_profile import TorchProfileSession
from src.runtime import RunContext, settings, setup_logging
from src.tracking.curves import plot_curves, read_metrics
from src.tracking.mlflow_run import (
    ELASTIC_RUN_FILE,
    RUN_ARTIFACTS,
    RUN_ID_FILE,
    MlflowTracker,
    NullTracker,
    default_run_name,
    experiment_name,
    flatten,
    run_tags,
    start_tracker,
    write_json,
)
from src.train.checkpoint import Checkpointer, export_safetensors, latest_checkpoint
from src.train.faults import inject
from src.train.loop import summarize, train_loop
from src.train.metrics import flops_per_token, peak_flops, reset_peak_memory
from src.train.optimizer import build_optimizer, optimizer_impl
from src.train.progress import ProgressReporter
from src.train.schedule import lr_at

log = logging.getLogger("src.train")


def profile_session(cfg: DictConfig, flops_per_step: float) -> TorchProfileSession:
    p = cfg.profile
    return TorchProfileSession(p.wait, p.warmup, p.active, p.record_shapes, p.profile_memory, p.with_stack, p.row_limit,
                               flops_per_step, p.gemm_peak_tflops)


def _log_auto_choice(cfg: DictConfig, kernels: FusedModel, run_dir: Path | None, tracker) -> None:
    """kernels=auto: say what the diagnosis chose and why, on the console and in MLflow."""
    from src.fusion.choice import choose, write_choice

    choice = choose(Path(cfg.kernels.diagnosis))
    log.info("kernels=auto from %s (%s): %s", choice.diagnosis, choice.device or "unknown GPU", choice.describe())
    for op, reasons in choice.ops.items():
        note = "" if kernels.swapped.get(op, 1) else "  (this model has none to swap)"
        log.info("  %s%s <- %s", op, note, "; ".join(reasons))
    for op, ms in cfg.kernels.measured.items():
        log.info("  measured %s: %s", op, ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()))
    tracker.set_tags({
        "kernels.auto": choice.describe(), "kernels.diagnosis": choice.diagnosis,
        "kernels.auto.fused": ",".join(cfg.kernels.fused) or "none", "kernels.auto.compiled": ",".join(cfg.kernels.compiled) or "none",
        "kernels.auto.decided_by": "measurement" if cfg.kernels.measured else "diagnosis",
    })
    # the timings also travel as params (the flattened config): kernels.measured.OP.CANDIDATE
    if run_dir is not None:
        write_choice(choice, kernels.swapped, run_dir / "kernels_auto.json", cfg.kernels)
        tracker.log_artifact(run_dir / "kernels_auto.json")


def _make_tracker(cfg: DictConfig, ctx: RunContext, env: DistEnv, run_dir: Path | None):
    if not (env.is_main and cfg.tracking.enabled):
        return NullTracker()
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else env.device.type
    id_file = run_dir / RUN_ID_FILE if run_dir is not None else None
    # an earlier attempt of this elastic run opened the MLflow run (src/tracking/mlflow_run.py)
    elastic_file = run_dir / ELASTIC_RUN_FILE if run_dir is not None else None
    restarted = (elastic_file is not None and elastic_file.exists() and "TORCHELASTIC_RUN_ID" in os.environ
                 and elastic_file.read_text().strip() == os.environ["TORCHELASTIC_RUN_ID"])
    return MlflowTracker(
        uri=ctx.tracking_uri or cfg.tracking.uri,
        experiment=experiment_name(cfg),
        run_name=cfg.tracking.run_name or default_run_name(cfg, ctx.overrides, ctx.sweep_keys),
        params=flatten(OmegaConf.to_container(cfg, resolve=True)),
        tags=run_tags(ctx.overrides, env.world_size, device_name, ctx.cwd),
        run_dir=run_dir,
        parent_run_id=ctx.parent_run_id,
        system_metrics_interval_s=cfg.tracking.system_metrics_interval_s if cfg.tracking.system_metrics else 0.0,
        connect_timeout_s=cfg.tracking.connect_timeout_s,
        retry_s=cfg.tracking.retry_s,
        continue_run_id=id_file.read_text().strip() if (restarted and id_file is not None and id_file.exists()) else None,
    )


class MetricsFile:
    """Every logged step as a JSON line in <run_dir>/metrics.jsonl: the run's own record, kept
    whether or not a tracking store was reachable (src.compare reads it). One line per step: after
    an elastic restart the steps from `start_step` on run again, so their first lines are dropped."""

    def __init__(self, path: Path, start_step: int = 0):
        if path.exists():
            kept = [line for line in path.read_text().splitlines() if line.strip() and json.loads(line)["step"] < start_step]
            path.write_text("".join(line + "\n" for line in kept))
        self.file = open(path, "a", buffering=1)

    def __call__(self, s) -> None:
        self.file.write(json.dumps({"step": s.step, **s.metrics()}) + "\n")

    def close(self) -> None:
        self.file.close()


def train(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """Train on this rank. Returns the summary (the same dict on every rank; rank 0 also writes it)."""
    backend = cfg.backend.dist_backend
    if cfg.sharding.cpu_offload and backend == "nccl":
        backend = "cuda:nccl,cpu:gloo"  # offloaded gradients are reduced (their norm) on host memory
    env = init_distributed(cfg.backend.device_type, backend, cfg.dist.timeout_s)
    if env.world_size > 1 and launched_as_worker():
        # Under torchrun each rank composed its own config; rank 0's run directory is the run's
        # (the checkpoint folder, per-rank traces and error notes live there for every rank).
        shared = [ctx.run_dir]
        dist.broadcast_object_list(shared, src=0)
        ctx = replace(ctx, run_dir=shared[0])
    run_dir = Path(ctx.run_dir) if (ctx.run_dir and env.is_main) else None
    if ctx.run_dir:  # a note left by this rank's previous attempt (an elastic restart) is stale
        (Path(ctx.run_dir) / ERROR_NOTE.format(rank=env.rank)).unlink(missing_ok=True)
    setup_logging(run_dir, env.rank)
    tracker = _make_tracker(cfg, ctx, env, run_dir)
    reporter = metrics_file = None
    try:
        torch.manual_seed(cfg.train.seed)
        strategy = cfg.sharding.strategy
        compute_dtype = torch_dtype(cfg.precision.param_dtype)

        with torch.device("meta"):
            model = build_model(cfg.model)
        n_params = model.num_params(non_embedding=False)
        fpt = flops_per_token(model.num_params(non_embedding=True), cfg.model.n_layers, cfg.model.n_heads, cfg.model.dim // cfg.model.n_heads, cfg.data.seq_len)
        kernels = FusedModel({})
        fused_ops = selected_ops(cfg.kernels.fused)
        if fused_ops:
            kernels = apply_fused(model, fused_ops, cfg.train.label_smoothing)
            if env.is_main:
                log.info("fused Triton kernels: %s", kernels.describe())
        if cfg.kernels.compiled:
            from src.fusion.compiled import apply_compiled

            compiled_swapped, compiled_loss = apply_compiled(model, list(cfg.kernels.compiled))
            if compiled_loss is not None and kernels.loss_fn is None and not kernels.loss_in_model:
                kernels.loss_fn = compiled_loss
            if env.is_main:
                log.info("ops under torch.compile: %s", ", ".join(f"{op} x{n}" for op, n in compiled_swapped.items()) + (" cross_entropy" if compiled_loss else ""))
        after_optimizer = None
        if cfg.precision.float8:  # torchtitan's order: float8 swap, then compile, then fully_shard
            from src.train.float8 import convert_blocks_to_float8, scale_precompute

            gather_fp8 = cfg.precision.fp8_all_gather and cfg.precision.fp8_recipe == "tensorwise" and strategy in ("fsdp2", "hsdp")
            n_fp8 = convert_blocks_to_float8(model, cfg.precision.fp8_recipe, gather_fp8)
            after_optimizer = scale_precompute(model) if gather_fp8 else None
            if env.is_main:
                log.info("float8 (%s scales): %d block linears, weights all-gathered in %s", cfg.precision.fp8_recipe, n_fp8, "float8" if gather_fp8 else "bf16")
        if cfg.profile.nvtx:
            module_ranges(model)  # before compile and sharding: hooks on the plain modules
        if cfg.kernels.compile:
            # in place (nn.Module.compile), so parameter names and checkpoints stay those of eager;
            # torchtitan wraps instead (torch.compile(block)): the same graph, one per block
            for block in model.layers:
                block.compile(backend=cfg.kernels.compile_backend)

        autocast_dtype = None
        dp_rank, dp_world = env.rank, env.world_size
        if strategy in ("fsdp2", "hsdp"):
            mesh = build_mesh(env.device.type, env.world_size, strategy, cfg.sharding.replicate)
            apply_fsdp(
                model, mesh, mixed_precision_policy(cfg.precision.param_dtype, cfg.precision.reduce_dtype),
                cfg.sharding.reshard_after_forward, cfg.sharding.cpu_offload,
            )
        elif compute_dtype != torch.float32:
            autocast_dtype = compute_dtype  # unsharded mixed precision: fp32 weights, autocast compute
        init_device = torch.device("cpu") if cfg.sharding.cpu_offload else env.device
        materialize_and_init(model, init_device, cfg.train.seed)
        if strategy == "none" and env.world_size > 1:
            model = DistributedDataParallel(model, device_ids=[env.local_rank] if env.device.type == "cuda" else None)

        optimizer = build_optimizer(model.parameters(), cfg.optim, env.device.type, cfg.sharding.cpu_offload)
        checkpointer, start_step, resumed_from = None, 0, None
        ck = cfg.checkpoint
        folder = Path(ck.folder) if ck.folder else (Path(ctx.run_dir) / "checkpoints" if ctx.run_dir else None)
        if ck.enabled or ck.resume not in ("auto", "none"):
            if folder is None and ck.enabled:
                raise ValueError("checkpoint.enabled needs a run directory or checkpoint.folder")
            checkpointer = Checkpointer(folder, model, optimizer, ck.keep_last, ck.async_mode, OmegaConf.to_yaml(cfg.model))
            resumed_from = Path(ck.resume) if ck.resume not in ("auto", "none") else (latest_checkpoint(folder) if ck.resume == "auto" and folder else None)
            if resumed_from is not None:
                start_step = checkpointer.load(resumed_from)
        batches = TokenBatches(
            cfg.data.source, cfg.model.vocab_size, cfg.data.batch_size, cfg.data.seq_len, cfg.train.seed,
            dp_rank, dp_world, env.device, cfg.data.text_path, cfg.data.corpus_mb,
        )
        batches.step = start_step  # the data position is the step: the batch of step s depends on (seed, s) only
        peak = peak_flops(env.device, cfg.precision.param_dtype)
        tracker = start_tracker(tracker)
        if cfg.kernels.auto and env.is_main:
            _log_auto_choice(cfg, kernels, run_dir, tracker)
        if resumed_from is not None:
            tracker.set_tags({"resumed_from": str(resumed_from), "resumed_at_step": str(start_step)})
        if env.is_main:
            log.info(
                "%s: %.1fM params, %s over %d rank(s) on %s, %s, batch %dx%d per device, %d steps",
                cfg.model.name, n_params / 1e6, cfg.sharding.name, env.world_size, env.device.type,
                cfg.precision.name, cfg.data.batch_size, cfg.data.seq_len, cfg.train.steps,
            )
        callbacks = []
        if env.is_main:
            reporter = ProgressReporter(cfg.train.steps, cfg.train.progress, cfg.train.seed_line)
            callbacks = [reporter, lambda s: tracker.log_step(s.step, s.metrics())]
            if run_dir is not None:
                metrics_file = MetricsFile(run_dir / "metrics.jsonl", start_step)
                callbacks.append(metrics_file)
        session = profile_session(cfg, fpt * cfg.data.batch_size * cfg.data.seq_len) if cfg.task.name == "profile" else None
        if session is not None:
            session.start(env.device, env.rank, Path(ctx.run_dir) / "profile" if ctx.run_dir else None)
        reset_peak_memory(env.device)
        try:
            result = train_loop(
                model, optimizer, batches, cfg.train.steps, env.device,
                tokens_per_step_per_device=cfg.data.batch_size * cfg.data.seq_len,
                world_size=env.world_size, flops_per_token=fpt, peak_flops=peak,
                grad_clip=cfg.optim.grad_clip, autocast_dtype=autocast_dtype, loss_fp32=cfg.train.loss_fp32, loss_fn=kernels.loss_fn, loss_in_model=kernels.loss_in_model, label_smoothing=cfg.train.label_smoothing,
                log_every=cfg.train.log_every, on_step=callbacks,
                fault=partial(inject, cfg.fault.kind, cfg.fault.rank, cfg.fault.step, env.rank),
                mark=step_marker(cfg.profile.nvtx) if cfg.profile.nvtx else None,
                profiled_step=cfg.profile.nvtx_step,
                profiled_step_range=profiled_step,
                after_step=session.step if session is not None else None,
                start_step=start_step,
                checkpoint_due=(lambda n: ck.enabled and ((ck.interval > 0 and n % ck.interval == 0) or n == cfg.train.steps)),
                save_checkpoint=checkpointer.save if checkpointer is not None and ck.enabled else None,
                nonfinite=cfg.train.nonfinite,
                after_optimizer=after_optimizer,
                lr_at=partial(lr_at, lr=cfg.optim.lr, schedule=cfg.optim.schedule, warmup_steps=cfg.optim.warmup_steps,
                              total_steps=cfg.train.steps, min_lr_ratio=cfg.optim.min_lr_ratio),
            )
            if checkpointer is not None:
                checkpointer.wait()
            if ck.export_safetensors and ctx.run_dir:
                export_safetensors(model.module if isinstance(model, DistributedDataParallel) else model, Path(ctx.run_dir) / "model.safetensors")
        finally:
            if session is not None:
                session.stop()
        if reporter:
            reporter.close()
        if metrics_file:
            metrics_file.close()
        summary = {
            "task": cfg.task.name,
            "status": "finished",
            "settings": settings(cfg, env.world_size),
            "params": n_params,
            "flops_per_token": fpt,
            "optim_impl": optimizer_impl(cfg.optim.impl, env.device.type, cfg.sharding.cpu_offload),
            "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else env.device.type,
            **summarize(result, cfg.train.untimed_steps),
            "start_step": start_step,
            "resumed_from": str(resumed_from) if resumed_from else None,
            "checkpoints": checkpointer.saves if checkpointer is not None else [],
            "checkpoint_load_s": checkpointer.load_s if checkpointer is not None else None,
            "mlflow_run_id": tracker.run_id,
        }
        if session is not None and env.is_main:
            summary["profile"] = session.results
            for artifact in session.artifacts:
                tracker.log_artifact(artifact, "profile")
        if run_dir is not None:
            write_json(run_dir / "summary.json", summary)
            history = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else result.steps
            plot_curves(history, run_dir / "curves.png", title=default_run_name(cfg, ctx.overrides, ctx.sweep_keys))
            for name in RUN_ARTIFACTS:
                tracker.log_artifact(run_dir / name)
        anatomy = session.anatomy if session is not None and env.is_main else None
        tracker.finish("FINISHED", {**summary, **(anatomy_metrics(anatomy) if anatomy else {})})
        if env.is_main:
            if summary["skipped_steps"]:
                log.info("train.nonfinite=skip dropped the optimizer update of %d step(s): %s", summary["skipped_steps"], summary["skipped_at"])
            if summary["steps"] == 0:
                log.info("nothing to train: the checkpoint already covers train.steps=%d", cfg.train.steps)
            else:
                log.info(
                    "done: final loss %.4f, %s tok/s/device, MFU %s, peak %.2f GB, overhead %.2f%% of wall time",
                    summary["final_loss"], f"{summary['tokens_per_s_per_device']:,.0f}",
                    "n/a" if summary["mfu"] is None else f"{summary['mfu']:.1f}%", summary["peak_mem_gb"],
                    100 * summary["overhead_frac"],
                )
        return summary
    except BaseException as exc:
        if isinstance(exc, KeyboardInterrupt):
            # The agent forwards the launcher's SIGINT after the terminal's own reached us: a
            # second KeyboardInterrupt here would cut off recording the KILLED run.
            signal.signal(signal.SIGINT, signal.SIG_IGN)
        if int(os.environ.get("GROUP_WORLD_SIZE", "1")) > 1:
            # On several nodes the surviving ranks fail in a collective when a peer dies, and their
            # agent, seeing the failed node rejoin, SIGTERMs them to restart: that signal, arriving
            # while this rank records its error, cut the record short (no `error` tag, so no
            # restart_N.cause). The agent waits for the rank to exit (SIGKILL after 30 s).
            signal.signal(signal.SIGTERM, signal.SIG_IGN)
        if reporter:
            reporter.close()
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        if ctx.run_dir and not isinstance(exc, (KeyboardInterrupt, SystemExit)):  # the launcher's line if the elastic error file is missing
            first = (str(exc).strip().splitlines() or [""])[0]
            (Path(ctx.run_dir) / ERROR_NOTE.format(rank=env.rank)).write_text(f"{type(exc).__name__}: {first}"[:2000])
        if tracker.run_id:
            tracker.finish(status, error=f"rank {env.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise
    finally:
        shutdown()


def elastic_entry(cfg_container: dict, ctx_fields: dict) -> dict[str, Any]:
    """What each rank runs under the elastic launcher (spawned: it rebuilds the config from a dict)."""
    cfg = OmegaConf.create(cfg_container)
    return train(cfg, RunContext(**ctx_fields))
