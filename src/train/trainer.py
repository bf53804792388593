"""task=train on one rank, torchtitan's train.py in small: `Trainer(cfg, ctx)` joins the process
group and opens the tracker; `build()` makes the model (meta device, fused swaps, parallelize()),
the optimizer, the checkpointer and the data; `train()` runs the loop and returns the summary
(the same dict on every rank but for the gpu_* clock figures, which only rank 0 samples; rank 0 also
writes summary.json, curves.png and the MLflow run).

The step is the Trainer's, as torchtitan's is: `forward_backward_step(inputs, targets)`, then
`train_step(inputs, targets)` (grad norm, clipping, AdamW), each with the settings build() holds;
src/train/loop.py runs the steps, times them and reads their figures.
"""
from __future__ import annotations

import contextlib
import json
import logging
import os
import signal
import traceback
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from omegaconf import DictConfig, OmegaConf
from torch.nn.parallel import DistributedDataParallel

from src.data.batches import TokenBatches
from src.distributed.cluster import submitit_job
from src.distributed.env import build_mesh, init_distributed, launched_as_worker
from src.distributed.launch import ERROR_NOTE
from src.distributed.parallelize import parallelize
from src.fusion.registry import FusedModel, apply_fused, selected_ops
from src.fusion.trial import HEAD_MARGIN, LossTrial, room
from src.models import meta_model
from src.profiling.anatomy import metrics as anatomy_metrics
from src.profiling.annotate import profiled_step, step_marker
from src.profiling.gpu_clocks import FIGURES as CLOCK_FIGURES
from src.profiling.gpu_clocks import ClockSampler, describe
from src.profiling.torch_profile import TorchProfileSession
from src.runtime import RunContext, settings, setup_logging, world_size
from src.speed.inductor import cudagraph_counts, cudagraph_skips
from src.tracking.curves import plot_curves, read_metrics
from src.tracking.mlflow_run import RUN_ARTIFACTS, default_run_name, start_tracker, write_json
from src.train.checkpoint import Checkpointer, export_safetensors, latest_checkpoint
from src.train.faults import inject
from src.train.loop import (
    LoopHooks,
    LoopResult,
    Throughput,
    forward_backward_step,
    optimizer_step,
    summarize,
    train_loop,
)
from src.train.metrics import causal_flops_per_token, energy_and_cost, peak_flops, reset_peak_memory
from src.train.optimizer import build_optimizer, optimizer_impl
from src.train.preempt import STOP_FILE, StopRequest, stop_signals
from src.train.progress import ProgressReporter
from src.train.records import MetricsFile, log_auto_choice, make_tracker
from src.train.schedule import lr_at

log = logging.getLogger("src.train")


def profile_session(cfg: DictConfig, flops_per_step: float) -> TorchProfileSession:
    p = cfg.profile
    return TorchProfileSession(p.wait, p.warmup, p.active, p.record_shapes, p.profile_memory, p.with_stack, p.row_limit,
                               flops_per_step, p.gemm_peak_tflops)


class Trainer:
    def __init__(self, cfg: DictConfig, ctx: RunContext):
        backend = cfg.backend.dist_backend
        if cfg.sharding.cpu_offload and backend == "nccl":
            backend = "cuda:nccl,cpu:gloo"  # offloaded gradients are reduced (their norm) on host memory
        fake_world = world_size(cfg) if cfg.dist.fake else 0
        self.env = env = init_distributed(cfg.backend.device_type, backend, cfg.dist.timeout_s, fake_world)
        if env.world_size > 1 and launched_as_worker():
            # Under torchrun each rank composed its own config; rank 0's run directory is the run's
            # (the checkpoint folder, per-rank traces and error notes live there for every rank).
            shared = [ctx.run_dir]
            dist.broadcast_object_list(shared, src=0)
            ctx = replace(ctx, run_dir=shared[0])
        self.cfg, self.ctx = cfg, ctx
        self.graph_skips_before = cudagraph_skips() if cfg.speed.cudagraphs else None
        self.run_dir = Path(ctx.run_dir) if (ctx.run_dir and env.is_main) else None
        if ctx.run_dir:  # a note left by this rank's previous attempt (an elastic restart) is stale
            (Path(ctx.run_dir) / ERROR_NOTE.format(rank=env.rank)).unlink(missing_ok=True)
        setup_logging(self.run_dir, env.rank)
        self.tracker = make_tracker(cfg, ctx, env, self.run_dir)
        self.reporter: ProgressReporter | None = None
        self.metrics_file: MetricsFile | None = None
        self.step = 0
        """the step being run, counted from 0 (a checkpoint after N steps resumes at N)"""
        self.session: TorchProfileSession | None = None
        self.loss_trial: LossTrial | None = None
        self.clocks: ClockSampler | None = None
        self.clock_figures: dict[str, Any] | None = None
        nvtx = cfg.profile.nvtx
        self.mark = step_marker(nvtx) if nvtx else (lambda name: contextlib.nullcontext())

    def build(self) -> None:
        """The model on the meta device, its fused swaps, parallelize(), then optimizer, checkpoint
        (and resume), data and the step callbacks."""
        cfg, env = self.cfg, self.env
        torch.manual_seed(cfg.train.seed)
        model = meta_model(cfg.model)
        self.n_params = model.num_params(non_embedding=False)
        self.fpt = model.flops_per_token(cfg.data.seq_len)  # src/models/protocol.py: torchtitan's count
        self.fpt_causal = causal_flops_per_token(self.fpt, model.attention_flops_per_token(cfg.data.seq_len), cfg.model.causal)
        self.kernels = self._swap_kernels(model)
        mesh = None
        if cfg.sharding.strategy in ("fsdp2", "hsdp"):
            mesh = build_mesh(env.device.type, env.world_size, cfg.sharding.strategy, cfg.sharding.replicate)
        laid = parallelize(model, cfg, mesh, env.device)
        self.model, self.autocast_dtype, self.after_optimizer = laid.model, laid.autocast_dtype, laid.after_optimizer
        self.speed = laid.speed
        self.optimizer = build_optimizer(self.model.parameters(), cfg.optim, env.device.type, cfg.sharding.cpu_offload, cfg.train.seed)
        if "cast_in_step" in self.speed:
            self._cast_in_step()
        self._checkpoint_and_resume()
        self.batches = TokenBatches(
            cfg.data.source, cfg.model.vocab_size, cfg.data.batch_size, cfg.data.seq_len, cfg.train.seed,
            env.rank, env.world_size, env.device, cfg.data.text_path, cfg.data.corpus_mb, cfg.data.tokens_path,
        )
        self.batches.step = self.start_step  # the data position is the step: the batch of step s depends on (seed, s) only
        self.stop = self._stop_request()
        self.peak = peak_flops(env.device, cfg.precision.param_dtype)
        self.tracker = start_tracker(self.tracker)
        if cfg.kernels.auto and env.is_main:
            log_auto_choice(cfg, self.kernels, self.run_dir, self.tracker)
        self.loss_trial = self._loss_trial()
        # which of torch's functions this run replaced (the torch tag says which torch): a column to compare runs by
        tags = {"speed.recipes": ",".join(self.speed) or "none"}
        if self.resumed_from is not None:
            tags.update(resumed_from=str(self.resumed_from), resumed_at_step=str(self.start_step))
        self.tracker.set_tags(tags)
        if env.is_main:
            log.info(
                "%s: %.1fM params, %s over %d rank(s) on %s, %s, batch %dx%d per device, %d steps",
                cfg.model.name, self.n_params / 1e6, cfg.sharding.name, env.world_size,
                f"{env.device.type} (rank 0 alone, collectives faked: dist.fake)" if cfg.dist.fake else env.device.type,
                cfg.precision.name, cfg.data.batch_size, cfg.data.seq_len, cfg.train.steps,
            )
        self.callbacks = []
        if env.is_main:
            self.reporter = ProgressReporter(cfg.train.steps, cfg.train.progress, cfg.train.seed_line)
            self.callbacks = [self.reporter, lambda s: self.tracker.log_step(s.step, s.metrics())]
            if self.run_dir is not None:
                self.metrics_file = MetricsFile(self.run_dir / "metrics.jsonl", self.start_step)
                self.callbacks.append(self.metrics_file)
            # the GPU's clock and power over the timed steps: a step at its power cap runs its kernels
            # at a lower clock than they run alone (src/profiling/gpu_clocks.py)
            self.clocks = ClockSampler.for_device(env.device, cfg.train.gpu_clock_interval_s)

    def _stop_request(self) -> StopRequest | None:
        """checkpoint.on_signal, where there is a checkpointer to save with: the ranks agree on a gloo
        group of their own, so the agreement never waits behind NCCL's queue."""
        sigs = stop_signals(self.cfg.checkpoint.on_signal, submitit_job() is not None)
        if not sigs or self.checkpointer is None:
            return None
        group = dist.new_group(backend="gloo") if self.env.world_size > 1 and not self.cfg.dist.fake else None
        return StopRequest(sigs, Path(self.ctx.run_dir) / STOP_FILE if self.ctx.run_dir else None, group)

    def _cast_in_step(self) -> None:
        """speed.cast_in_step: where it applies (TritonAdamW, one-rank groups unsharded directly),
        the update writes the unsharded parameters and they stay allocated; the log says so and
        what it holds."""
        from src.speed.one_rank import cast_in_step

        n, kept = cast_in_step(self.model, self.optimizer)
        if not n:
            self.speed.remove("cast_in_step")
        elif self.env.is_main:
            log.info("speed.cast_in_step: the Triton AdamW update writes %d parameters' %s casts into their one-rank unsharded "
                     "storage, kept between steps (%.2f GB); unshards cast only what changed since", n, self.cfg.precision.param_dtype, kept / 1e9)

    def _swap_kernels(self, model: torch.nn.Module) -> FusedModel:
        """kernels.fused (Triton) and kernels.compiled (single ops under torch.compile), in place."""
        cfg, env = self.cfg, self.env
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
            elif compiled_loss is not None and kernels.loss_in_model:
                kernels.loss_beside_head = compiled_loss
            if env.is_main:
                log.info("ops under torch.compile: %s", ", ".join(f"{op} x{n}" for op, n in compiled_swapped.items()) + (" cross_entropy" if compiled_loss else ""))
        return kernels

    def _loss_trial(self) -> LossTrial | None:
        """kernels=auto on a GPU with kernels.loss_trial pairs: the run's own steps decide
        (src/fusion/trial.py), from the step after the first, between the fused head + loss and the
        logits with the loss alone (auto's head trial: the fused head swapped in beside a loss of its
        own), or else between the fused Triton loss and eager's. Not for a resumed run (the decision
        is not in the checkpoint: the resumed run keeps auto's pick) nor under task=profile (the
        profiler's cost would fall on the timed steps)."""
        cfg, env, k = self.cfg, self.env, self.kernels
        pairs = cfg.kernels.loss_trial
        head = k.loss_in_model and not cfg.precision.get("fp8_head")  # float8's logits GEMM runs only in the fused head
        fused_loss = "cross_entropy" in selected_ops(cfg.kernels.fused) and k.loss_fn is not None and not k.loss_in_model
        if not (cfg.kernels.auto and pairs and env.device.type == "cuda" and (head or fused_loss)):
            return None
        why_not = ("a resumed run keeps auto's pick" if self.start_step else
                   "task=profile would time the profiler" if cfg.task.name == "profile" else None)
        if head:
            other = "cross_entropy " + ("fused" if "cross_entropy" in selected_ops(cfg.kernels.fused) else
                                        "compiled" if k.loss_beside_head is not None else "eager")
            trial = LossTrial((None, True), 1, pairs, other=(k.loss_beside_head, False), names=("fused head", f"logits, {other}"),
                              margin=HEAD_MARGIN)
        else:
            trial = LossTrial((k.loss_fn, False), 1, pairs, other=(None, False))
        if why_not is None and not room(cfg.train.steps, pairs, trial.first):
            why_not = f"{cfg.train.steps} steps leave no room for it (step 1 and {2 * pairs} more)"
        if why_not:
            if env.is_main:
                log.info("kernels=auto: no loss trial (%s); the %s stays, untried", why_not, "fused head" if head else "fused loss")
            return None
        if env.is_main:
            log.info("kernels=auto: step %d runs the %s, steps %d-%d alternate it with the %s (kernels.loss_trial=%d); the faster stays",
                     trial.first, trial.names[1], trial.first + 1, trial.last, trial.names[0], pairs)
        return trial

    def _record_loss_trial(self, record: dict) -> None:
        """The trial's timings and decision: the log, MLflow (a tag and two metrics) and kernels_auto.json."""
        if not self.env.is_main:
            return
        picked_name, other_name = record["names"]
        kind = "head_trial" if picked_name == "fused head" else "loss_trial"
        log.info("kernels=auto %s, steps %d-%d: %s %.2f ms, %s %.2f ms a step (median, slowest rank) -> %s",
                 kind.replace("_", " "), *record["steps"], picked_name, record["picked_median_ms"], other_name, record["eager_median_ms"],
                 record["kept_name"])
        kept = record["kept_name"] if kind == "head_trial" else "fused" if record["kept"] == "picked" else "eager"
        tags = {f"kernels.auto.{kind}": kept}
        if record["kept"] != "picked":  # the run's fused list no longer has what the trial let go
            gone = "linear_cross_entropy" if kind == "head_trial" else "cross_entropy"
            tags["kernels.auto.fused"] = ",".join(op for op in self.cfg.kernels.fused if op != gone) or "none"
        self.tracker.set_tags(tags)
        first, second = ("fused_head_ms", "logits_ms") if kind == "head_trial" else ("fused_ms", "eager_ms")
        self.tracker.log_step(record["steps"][1], {f"auto.{kind}.{first}": record["picked_median_ms"],
                                                   f"auto.{kind}.{second}": record["eager_median_ms"]})
        path = self.run_dir / "kernels_auto.json" if self.run_dir is not None else None
        if path is not None and path.exists():
            auto = json.loads(path.read_text())
            auto[f"{kind}_result"] = record
            write_json(path, auto)
            self.tracker.log_artifact(path)

    def _checkpoint_and_resume(self) -> None:
        ck, ctx = self.cfg.checkpoint, self.ctx
        self.checkpointer, self.start_step, self.resumed_from = None, 0, None
        folder = Path(ck.folder) if ck.folder else (Path(ctx.run_dir) / "checkpoints" if ctx.run_dir else None)
        # a folder to save in on a stop signal (src/train/preempt.py) is one to resume from too
        if ck.enabled or ck.resume not in ("auto", "none") or (ck.on_signal and folder is not None and not self.cfg.dist.fake):
            if folder is None and ck.enabled:
                raise ValueError("checkpoint.enabled needs a run directory or checkpoint.folder")
            self.checkpointer = Checkpointer(folder, self.model, self.optimizer, ck.keep_last, ck.async_mode, OmegaConf.to_yaml(self.cfg.model))
            resumed = Path(ck.resume) if ck.resume not in ("auto", "none") else (latest_checkpoint(folder) if ck.resume == "auto" and folder else None)
            self.resumed_from = resumed
            if resumed is not None:
                self.start_step = self.checkpointer.load(resumed, verify=str(resumed) != ctx.verified_checkpoint)
                # DCP writes the shards through tensors of its own, moving no counter the kept casts
                # compare: at a resume nothing is kept yet (a parameter is, from its first unshard
                # on), so this guards a load after that
                if "cast_in_step" in self.speed:
                    from src.speed.one_rank import forget_casts

                    forget_casts(self.model)

    def train(self) -> dict[str, Any]:
        """build(), the loop (under torch.profiler for task=profile), then the summary and records."""
        cfg, env, ctx = self.cfg, self.env, self.ctx
        self.build()
        ck = cfg.checkpoint
        self.session = session = (profile_session(cfg, self.fpt * cfg.data.batch_size * cfg.data.seq_len)
                                  if cfg.task.name == "profile" else None)
        if session is not None:
            session.start(env.device, env.rank, Path(ctx.run_dir) / "profile" if ctx.run_dir else None)
        reset_peak_memory(env.device)
        callbacks = self.callbacks if self.clocks is None else [*self.callbacks, self.clocks.start_after(self.start_step + cfg.train.untimed_steps - 1)]
        try:
            hooks = LoopHooks(
                on_step=callbacks,
                checkpoint_due=(lambda n: ck.enabled and ((ck.interval > 0 and n % ck.interval == 0) or n == cfg.train.steps)),
                save_checkpoint=self.checkpointer.save if self.checkpointer is not None else None,
                stop_due=self.stop.agreed if self.stop is not None else None,
            )
            result = train_loop(
                self.run_step, self.optimizer, self.batches, cfg.train.steps, env.device,
                Throughput(cfg.data.batch_size * cfg.data.seq_len, env.world_size, self.fpt, self.peak),
                hooks, log_every=cfg.train.log_every, start_step=self.start_step,
                # dist.fake: the gathered weights are not the model's, so a NaN says nothing of the run
                nonfinite="unchecked" if cfg.dist.fake and cfg.train.nonfinite == "fail" else cfg.train.nonfinite,
            )
            if self.checkpointer is not None:
                self.checkpointer.wait()
            if ck.export_safetensors and ctx.run_dir and not result.stopped_by:  # a stopped run exports when it finishes
                model = self.model
                export_safetensors(model.module if isinstance(model, DistributedDataParallel) else model, Path(ctx.run_dir) / "model.safetensors")
        finally:
            if self.stop is not None:
                self.stop.close()
            if session is not None:
                session.stop()
            if self.clocks is not None:
                self.clock_figures = self.clocks.stop()
        if self.reporter:
            self.reporter.close()
        if self.metrics_file:
            self.metrics_file.close()
        return self._finish(result, session)

    def forward_backward_step(self, inputs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Forward, loss and backward under this run's autocast, loss (fused or not, fp32 or not)
        and fault; returns the loss, gradients left in the parameters' .grad."""
        cfg = self.cfg
        return forward_backward_step(
            self.model, inputs, targets, self.autocast_dtype, cfg.train.loss_fp32, self.mark, self._fault,
            self.kernels.loss_fn, self.kernels.loss_in_model, cfg.train.label_smoothing,
        )

    def train_step(self, inputs: torch.Tensor, targets: torch.Tensor, need_norm: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """One optimizer step: forward_backward_step, then grad norm, clipping, the optimizer (and
        float8's scales); returns (loss, global grad norm) as device tensors, not yet synced; the
        norm None when `need_norm` is false and neither clipping nor skipping needs it."""
        self.optimizer.zero_grad(set_to_none=True)
        norm_from = None
        if "norm_in_copy_in" in self.speed:
            from src.speed.grad_squares import SQUARES

            SQUARES.clear()  # only this step's copies count
            norm_from = SQUARES.norm
        if self.cfg.speed.cudagraphs:
            # the trees' outputs of the last step are dead from here: its graphs may be replayed over them
            torch.compiler.cudagraph_mark_step_begin()
        loss = self.forward_backward_step(inputs, targets)
        norm = optimizer_step(self.model, self.optimizer, self.cfg.optim.grad_clip, self.mark,
                              self.cfg.train.nonfinite == "skip", self.after_optimizer, need_norm,
                              clip_in_update=self.cfg.speed.clip_in_update, norm_from=norm_from)
        return loss.detach(), norm

    def run_step(self, step: int, inputs: torch.Tensor, targets: torch.Tensor, read: bool = True) -> tuple[torch.Tensor, torch.Tensor | None]:
        """What train_loop calls per step: the step's learning rate, train_step (inside ncu's range
        on profile.nvtx_step), then the profiler's step. `read`: train_loop will read this step's
        figures (the grad norm among them); a step it will not read skips the norm."""
        cfg = self.cfg
        self.step = step
        lr = lr_at(step, lr=cfg.optim.lr, schedule=cfg.optim.schedule, warmup_steps=cfg.optim.warmup_steps,
                   total_steps=cfg.train.steps, min_lr_ratio=cfg.optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        trial = self.loss_trial
        if trial is not None:
            self.kernels.loss_fn, self.kernels.loss_in_model = trial.loss_at(step)
            trial.begin(step)
        with profiled_step() if step == cfg.profile.nvtx_step else contextlib.nullcontext():
            loss, norm = self.train_step(inputs, targets, need_norm=read)
        if trial is not None:
            trial.end(step)
            record = trial.settle(step)
            if record is not None:
                reset_peak_memory(self.env.device)  # later steps and the summary: the kept loss's peak, not the trial's
                self._record_loss_trial(record)
        if self.session is not None:
            self.session.step()
        return loss, norm

    def _fault(self, loss: torch.Tensor) -> torch.Tensor:
        """cfg.fault at its step on its rank (src/train/faults.py); the loss itself otherwise."""
        f = self.cfg.fault
        return inject(f.kind, f.rank, f.step, self.env.rank, self.step, loss)

    def _finish(self, result: LoopResult, session: TorchProfileSession | None) -> dict[str, Any]:
        """summary.json, curves.png and the run's artifacts; the tracker FINISHED; the last log line."""
        cfg, env, ctx, tracker, checkpointer = self.cfg, self.env, self.ctx, self.tracker, self.checkpointer
        stopped = signal.Signals(result.stopped_by).name if result.stopped_by else None
        summary = {
            "task": cfg.task.name,
            "status": "preempted" if stopped else "finished",
            "preempted_by": stopped,
            "preempted_at_step": result.stopped_at if stopped else None,
            "settings": settings(cfg, env.world_size),
            "params": self.n_params,
            "flops_per_token": self.fpt,
            "optim_impl": optimizer_impl(cfg.optim.impl, env.device.type, cfg.sharding.cpu_offload),
            "speed_recipes": list(self.speed),
            "torch_version": torch.__version__,
            "device_name": torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else env.device.type,
            **summarize(result, cfg.train.untimed_steps),
            "start_step": self.start_step,
            "resumed_from": str(self.resumed_from) if self.resumed_from else None,
            "checkpoints": checkpointer.saves if checkpointer is not None else [],
            "checkpoint_load_s": checkpointer.load_s if checkpointer is not None else None,
            "mlflow_run_id": tracker.run_id,
            # rank 0's GPU over the timed steps (None where not sampled: a CPU, no NVML, off)
            **(self.clock_figures or dict.fromkeys(CLOCK_FIGURES)),
        }
        # MFU in both conventions: `mfu` counts attention whole (torchtitan), `mfu_causal` halves a
        # causal mask's (Megatron-Bridge); and the energy and price of a token
        summary["mfu_causal"] = summary["mfu"] * self.fpt_causal / self.fpt if summary.get("mfu") is not None else None
        summary.update(energy_and_cost(summary, cfg.train.gpu_hour_price))
        if summary["mfu"] is None:
            summary["na"].update(mfu="no datasheet peak for this device", mfu_causal="no datasheet peak for this device")
        if self.graph_skips_before is not None:
            # speed.cudagraphs: the graphs held and re-recorded, and compiled graphs that ran launched
            # instead (this process, this run)
            counts = cudagraph_counts(env.device)
            summary.update(cudagraphs=counts["graphs"], cudagraph_rerecords=counts["rerecords"],
                           cudagraph_skips=cudagraph_skips() - self.graph_skips_before)
        if session is not None and env.is_main:
            summary["profile"] = session.results
            for artifact in session.artifacts:
                tracker.log_artifact(artifact, "profile")
        run_dir = self.run_dir
        if run_dir is not None:
            write_json(run_dir / "summary.json", summary)
            history = read_metrics(run_dir / "metrics.jsonl") if (run_dir / "metrics.jsonl").exists() else result.steps
            plot_curves(history, run_dir / "curves.png", title=default_run_name(cfg, ctx.overrides, ctx.sweep_keys))
            for name in RUN_ARTIFACTS:
                tracker.log_artifact(run_dir / name)
        anatomy = session.anatomy if session is not None and env.is_main else None
        if stopped:
            tracker.set_tags({"preempted": stopped, "preempted_at_step": str(result.stopped_at)})
        tracker.finish("KILLED" if stopped else "FINISHED", {**summary, **(anatomy_metrics(anatomy) if anatomy else {})})
        if env.is_main and not stopped and not ctx.multirun:  # a sweep prints its own view
            # the launcher's last line (src/run.py), made here where MLflow is loaded; not in summary.json
            summary["mlflow_hint"] = tracker.view_hint(cfg.task.name, cfg.tracking.uri)
        if env.is_main:
            if summary["skipped_steps"]:
                log.info("train.nonfinite=skip dropped the optimizer update of %d step(s): %s", summary["skipped_steps"], summary["skipped_at"])
            if summary.get("cudagraph_skips"):
                log.warning("speed.cudagraphs: %d compiled graph(s) ran their kernels launched one by one instead of replayed "
                            "from a CUDA graph; Inductor logged why above ('skipping cudagraphs due to ...')", summary["cudagraph_skips"])
            if summary.get("cudagraph_rerecords"):
                # each re-recording is a step's worth of capture on the host; more than a few per graph cost more than graphs save
                log.warning("speed.cudagraphs: %d graph(s) recorded again because a weight they read had moved (%d graphs held); "
                            "if the steps are slower than with speed.cudagraphs=false, drop it", summary["cudagraph_rerecords"], summary["cudagraphs"])
            if stopped:
                at = result.stopped_at
                saved = f"checkpoint step_{at:08d} in {self.checkpointer.folder}" if at > self.start_step else "nothing new to save"
                again = ("the sweep's command with sweep.resume=true" if ctx.multirun
                         else "`" + " ".join(["python -m src.run", *ctx.overrides]) + "`")
                log.warning("%s: stopped after %d of %d steps, %s; %s continues it: this folder, its checkpoint and its MLflow run "
                            "(checkpoint.resume=auto)", stopped, at, cfg.train.steps, saved, again)
            elif summary["steps"] == 0:
                log.info("nothing to train: the checkpoint already covers train.steps=%d", cfg.train.steps)
            else:
                log.info(
                    "done: final loss %.4f, %s tok/s/device, MFU %s, peak %.2f GB, overhead %.2f%% of wall time",
                    summary["final_loss"], f"{summary['tokens_per_s_per_device']:,.0f}",
                    "n/a" if summary["mfu"] is None else f"{summary['mfu']:.1f}%", summary["peak_mem_gb"],
                    100 * summary["overhead_frac"],
                )
            if self.clock_figures:
                log.info("GPU over the timed steps: %s", describe(self.clock_figures))
            if cfg.dist.fake:
                log.warning("dist.fake: rank 0 of %d alone, no data between ranks: the peak memory, compile and CUDA graphs are "
                            "a rank's of the real group; the losses and step times are not (its collectives take no time here)", env.world_size)
        return summary

    def record_failure(self, exc: BaseException) -> None:
        """This rank's error: a one-line note for the launcher, and the MLflow run FAILED (KILLED on
        Ctrl-C) with the traceback, without being cut short by the signals that follow a failure."""
        env, ctx = self.env, self.ctx
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
        if self.reporter:
            self.reporter.close()
        status = "KILLED" if isinstance(exc, KeyboardInterrupt) else "FAILED"
        if ctx.run_dir and not isinstance(exc, (KeyboardInterrupt, SystemExit)):  # the launcher's line if the elastic error file is missing
            first = (str(exc).strip().splitlines() or [""])[0]
            (Path(ctx.run_dir) / ERROR_NOTE.format(rank=env.rank)).write_text(f"{type(exc).__name__}: {first}"[:2000])
        if self.tracker.run_id:
            self.tracker.finish(status, error=f"rank {env.rank}: {type(exc).__name__}: {exc}\n{traceback.format_exc()}")
