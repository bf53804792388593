"""The training step and loop: forward, loss, backward, gradient norm, AdamW, per-step figures."""
from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from src.train.metrics import host_rss_mb, mfu_percent, peak_memory_gb
from src.train.optimizer import norm_in_update

log = logging.getLogger("src.train")


class NonFiniteLoss(RuntimeError):
    pass


@dataclass
class StepStats:
    step: int
    loss: float
    grad_norm: float
    step_time_s: float
    tokens_per_s: float
    tokens_per_s_per_device: float
    mfu: float | None
    peak_mem_alloc_gb: float
    peak_mem_reserved_gb: float
    rank0_peak_mem_alloc_gb: float
    lr: float | None = None
    """the learning rate this step's update used (optim.schedule)"""
    host_rss_mb: float | None = None
    """this rank's resident host memory after the step (rank 0's is the one logged)"""
    host_step_time_s: float | None = None
    """host time to queue a step (batch, forward, backward, optimizer launches), mean since the last
    read: well under step_time_s, the device is the limit; near it, the host is (or the launch
    queue is full, which blocks the host while the device catches up)"""

    def metrics(self) -> dict[str, float | None]:
        return {k: v for k, v in asdict(self).items() if k != "step"}


def forward_backward_step(
    model: nn.Module,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    autocast_dtype: torch.dtype | None = None,
    loss_fp32: bool = True,
    mark: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
    loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    loss_in_model: bool = False,
    label_smoothing: float = 0.0,
) -> torch.Tensor:
    """Forward, loss and backward (torchtitan's forward_backward_step); returns the loss, gradients
    left in the parameters' .grad."""
    autocast = (
        torch.autocast(inputs.device.type, dtype=autocast_dtype) if autocast_dtype is not None else contextlib.nullcontext()
    )
    with autocast:
        if loss_in_model:  # fused head + loss: the logits never exist (kernels/triton/linear_cross_entropy.py)
            with mark("loss"):
                loss = model(inputs, targets)
                if loss_hook is not None:
                    loss = loss_hook(loss)
        else:
            logits = model(inputs)  # (B, T, vocab)
            with mark("loss"):
                if loss_fp32:  # a bf16 loss is rounded to 8 mantissa bits (5.53 +- 0.02): upcast as torchtitan does
                    logits = logits.float()
                loss = (loss_fn or F.cross_entropy)(logits.reshape(-1, logits.size(-1)), targets.reshape(-1), label_smoothing=label_smoothing)
                if loss_hook is not None:
                    loss = loss_hook(loss)
    with mark("backward"):
        loss.backward()
    return loss


def train_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    inputs: torch.Tensor,
    targets: torch.Tensor,
    grad_clip: float = 0.0,
    autocast_dtype: torch.dtype | None = None,
    loss_fp32: bool = True,
    mark: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
    loss_hook: Callable[[torch.Tensor], torch.Tensor] | None = None,
    skip_nonfinite: bool = False,
    loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
    loss_in_model: bool = False,
    label_smoothing: float = 0.0,
    after_optimizer: Callable[[], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One optimizer step: forward_backward_step, then optimizer_step; returns (loss, global grad
    norm) as device tensors, not yet synced. `mark(name)` wraps loss, backward and optimizer in
    named ranges (NVTX for ncu) when asked. src/train/trainer.py's Trainer.train_step is the same
    step with its settings held by the Trainer."""
    optimizer.zero_grad(set_to_none=True)
    loss = forward_backward_step(model, inputs, targets, autocast_dtype, loss_fp32, mark, loss_hook, loss_fn, loss_in_model, label_smoothing)
    return loss.detach(), optimizer_step(model, optimizer, grad_clip, mark, skip_nonfinite, after_optimizer)


def optimizer_step(
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    grad_clip: float = 0.0,
    mark: Callable[[str], contextlib.AbstractContextManager] = lambda name: contextlib.nullcontext(),
    skip_nonfinite: bool = False,
    after_optimizer: Callable[[], None] | None = None,
    need_norm: bool = True,
    clip_in_update: bool = True,
    norm_from: Callable[[list[torch.Tensor]], torch.Tensor] | None = None,
) -> torch.Tensor | None:
    """After backward: the global grad norm, clipping and the optimizer; returns the norm as a
    device tensor. `skip_nonfinite` drops the optimizer step when the norm is NaN/inf (a device
    sync). `after_optimizer` runs after the update (float8: the next step's weight scales).
    `need_norm` false (a step nobody reads, no clipping, no skipping): no norm is computed and None
    returned; the norm reads every gradient, all-reduces over the mesh and costs host launches, which
    a step nobody reads need not pay. `clip_in_update` (speed.clip_in_update, torch's fused
    AdamW or optim.impl=triton's): the clipping factor goes to the update kernel instead of a pass
    over the gradients. `norm_from` (speed.norm_in_copy_in) gives the global norm of the gradients
    in place of get_total_norm's pass over them. An
    optimizer that sums the gradients' squares as it updates (optim.impl=triton) gives the norm of a
    step that only reports it (no clipping, no skipping)."""
    with mark("optimizer"):
        if not (need_norm or grad_clip > 0 or skip_nonfinite):
            optimizer.step()
            if after_optimizer is not None:
                after_optimizer()
            return None
        if grad_clip <= 0 and not skip_nonfinite and norm_in_update(optimizer):
            # the norm only reported: the update's own pass over the gradients sums their squares
            # (optim.impl=triton), no pass of its own
            optimizer.grad_norm_wanted = True
            try:
                optimizer.step()
            finally:
                optimizer.grad_norm_wanted = False
            if after_optimizer is not None:
                after_optimizer()
            return optimizer.last_grad_norm.detach()
        params = [p for p in model.parameters() if p.grad is not None]
        grads = [p.grad for p in params]
        if norm_from is not None:
            norm = norm_from(grads)
        else:
            norm = torch.nn.utils.get_total_norm(grads)
            if hasattr(norm, "full_tensor"):  # DTensor: the local shards' norms reduced over the mesh
                norm = norm.full_tensor()
        if skip_nonfinite and not bool(torch.isfinite(norm)):
            optimizer.zero_grad(set_to_none=True)
            return norm.detach()
        folded = grad_clip > 0 and clip_in_update and folds_clip(optimizer)
        if folded:
            # clip_grads_with_norm_ multiplies every gradient by min(1, clip / (norm + 1e-6)) in a
            # pass of its own (read + write of the fp32 gradients); fused AdamW divides each gradient
            # by its `grad_scale` (GradScaler's hook) as it reads it and writes the divided gradient
            # back, so the same factor, inverted, rides along: one read of the gradients and the
            # pass's launches fewer, no host sync
            if hasattr(optimizer, "grad_mul"):  # TritonAdamW (optim.impl=triton)
                # the factor clip_grads_with_norm_ computes, multiplied in the update kernel as that
                # pass would (rounded to the gradient's dtype): the same bits, the pass's read and
                # write of every gradient gone
                optimizer.grad_mul = torch.clamp(grad_clip / (norm + 1e-6), max=1.0).float()
            else:
                optimizer.grad_scale = torch.clamp((norm.float() + 1e-6) / grad_clip, min=1.0)
        elif grad_clip > 0:  # it takes the parameters and scales their .grad (given the gradients it finds none)
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip, norm)
        try:
            optimizer.step()
        finally:
            if folded and hasattr(optimizer, "grad_mul"):  # no factor left for a step() outside this one
                optimizer.grad_mul = None
            elif folded:  # as GradScaler does: no divisor left for a step() outside this one
                del optimizer.grad_scale
        if after_optimizer is not None:
            after_optimizer()
    return norm.detach()


def folds_clip(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` applies the clipping factor inside its own kernel: torch's Adam/AdamW with
    fused=True read `optimizer.grad_scale` (a divisor) in step() (foreach and for-loop ones refuse
    one); TritonAdamW reads `grad_mul` (a factor)."""
    return hasattr(optimizer, "grad_mul") or (isinstance(optimizer, torch.optim.Adam | torch.optim.AdamW) and bool(optimizer.defaults.get("fused")))


class Readback:
    """A logged step's loss, grad norm and peak memory on their way to the host, from every rank in
    one all_gather (mean loss, rank 0's norm, max memory).

    The gather and the copy into pinned host memory are queued right behind the step and an event
    marks their end, so `read()` waits for that step alone: the loop queues the next step first and
    reads after, and the device never idles while the host learns the loss and launches the next
    step's first kernels (read before the next step was queued, the loss left the device idle that
    long every step). On a CPU (gloo) the values are there at once."""

    def __init__(self, loss: torch.Tensor, norm: torch.Tensor, mem: tuple[float, float]):
        self.local_alloc_gb = mem[0]  # this rank's own peak (rank 0's is the one the seed prints)
        # norm lives where the gradients do: host memory under CPU offload, beside a device loss.
        # The memory figures are host numbers: a plain torch.tensor(x, device="cuda") is a blocking
        # copy from pageable memory, which torch ends with a stream sync, so every logged step would
        # wait for the device and the next step's launches would start from an idle GPU. From pinned
        # memory, non_blocking, the copy is queued like a kernel.
        host_mem = torch.tensor(mem, dtype=torch.float32, pin_memory=loss.is_cuda)
        local = torch.cat([torch.stack([loss.float(), norm.float().to(loss.device)]), host_mem.to(loss.device, non_blocking=True)])
        self.world = dist.get_world_size() if dist.is_initialized() else 1
        if self.world > 1:
            gathered = [torch.empty_like(local) for _ in range(self.world)]
            dist.all_gather(gathered, local)
            local = torch.stack(gathered)
        self.event = None
        if local.is_cuda:
            self.values = torch.empty(local.shape, dtype=local.dtype, pin_memory=True)
            self.values.copy_(local, non_blocking=True)
            # timed: the step's end on the device clock, whenever the host gets to read it
            self.event = torch.cuda.Event(enable_timing=True)
            self.event.record()
        else:
            self.values = local

    def read(self) -> tuple[float, float, float, float]:
        """(mean loss, rank 0's grad norm, max allocated GB, max reserved GB) once the step is done."""
        if self.event is not None:
            self.event.synchronize()
        rows = self.values.reshape(self.world, 4).tolist()
        return sum(r[0] for r in rows) / len(rows), rows[0][1], max(r[2] for r in rows), max(r[3] for r in rows)


@dataclass
class LoopResult:
    steps: list[StepStats]
    overhead_s: float
    wall_s: float
    skipped: list[int] = field(default_factory=list)
    """steps whose optimizer update train.nonfinite=skip dropped"""
    stopped_by: int = 0
    """the signal the loop stopped on before train.steps (src/train/preempt.py); 0: it ran them all"""
    stopped_at: int = 0
    """the steps done when it stopped (the step count of the checkpoint it saved then)"""


@dataclass
class Throughput:
    """What turns a step time into tokens/s and MFU."""

    tokens_per_step_per_device: int
    world_size: int
    flops_per_token: float
    peak_flops: float | None


@dataclass
class LoopHooks:
    """What the loop calls beside the steps: `on_step` with each read step's figures (logging, progress,
    profiling), `checkpoint_due(steps_done)` and `save_checkpoint(steps_done)`, and `stop_due()`, asked
    before each step (the same answer on every rank): a signal to stop on (src/train/preempt.py), or 0."""

    on_step: Iterable[Callable[[StepStats], None]] = ()
    checkpoint_due: Callable[[int], bool] = lambda steps_done: False
    save_checkpoint: Callable[[int], None] | None = None
    stop_due: Callable[[], int] | None = None


class StepClock:
    """Step time between two reads over the steps between them, host queue time beside it, and the
    overhead that follows a read (callbacks, checkpoint), counted apart so its share can be reported.
    On a GPU the clock is the device's (the host reads a step late by design: it queues the next one
    first, so host clocks would put part of one step in the next); elsewhere the host's."""

    def __init__(self, device: torch.device, start_step: int):
        self.device = device
        self.start = time.perf_counter()
        self.overhead = 0.0
        self.queued_s = 0.0  # host time spent queuing the steps since the last read
        self.last_read: tuple[int, float | torch.cuda.Event] = (start_step - 1, self.now())  # (step, when it ended)

    def now(self) -> float | torch.cuda.Event:
        if self.device.type != "cuda":
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def interval(self, step: int, end: float | torch.cuda.Event) -> tuple[float, float]:
        """(mean step time, mean host queue time) over the steps since the last read, which `step` becomes."""
        since, t0 = self.last_read
        dt = (t0.elapsed_time(end) / 1e3 if isinstance(t0, torch.cuda.Event) else end - t0) / (step - since)
        host_dt, self.queued_s = self.queued_s / (step - since), 0.0
        self.last_read = (step, end)
        return dt, host_dt

    def restart(self, step: int) -> None:
        """A step read at once (a CPU, a checkpoint): the device waited for the host meanwhile, so the
        next interval starts now, after the callbacks and the save, which are overhead."""
        self.last_read = (step, self.now())


class _Reads:
    """A read step's figures into StepStats, checked (train.nonfinite), handed to the hooks, and
    checkpointed where due."""

    def __init__(self, clock: StepClock, rate: Throughput, hooks: LoopHooks, nonfinite: str, start_step: int):
        self.clock, self.rate, self.hooks, self.nonfinite = clock, rate, hooks, nonfinite
        self.results: list[StepStats] = []
        self.saved_at = start_step  # the step count of the newest checkpoint (where the run resumed from, at first)

    def record(self, step: int, readback: Readback, lr: float | None, ckpt: bool) -> None:
        loss_v, norm_v, mem_alloc, mem_reserved = readback.read()
        t1 = time.perf_counter()
        dt, host_dt = self.clock.interval(step, readback.event if readback.event is not None else t1)
        if self.nonfinite == "fail" and not (math.isfinite(loss_v) and math.isfinite(norm_v)):
            # Checked before any checkpoint of this step is written: NaN weights are never saved.
            raise NonFiniteLoss(f"non-finite loss {loss_v} (grad norm {norm_v}) at step {step}")
        r = self.rate
        tps_dev = r.tokens_per_step_per_device / dt
        stats = StepStats(step=step, loss=loss_v, grad_norm=norm_v, step_time_s=dt, tokens_per_s=tps_dev * r.world_size,
                          tokens_per_s_per_device=tps_dev, mfu=mfu_percent(r.flops_per_token, tps_dev, r.peak_flops),
                          peak_mem_alloc_gb=mem_alloc, peak_mem_reserved_gb=mem_reserved, rank0_peak_mem_alloc_gb=readback.local_alloc_gb,
                          lr=lr, host_rss_mb=host_rss_mb(), host_step_time_s=host_dt)
        self.results.append(stats)
        for callback in self.hooks.on_step:
            callback(stats)
        self.clock.overhead += time.perf_counter() - t1
        if ckpt and self.hooks.save_checkpoint is not None:
            self.hooks.save_checkpoint(step + 1)
            self.saved_at = step + 1
        if readback.event is None or ckpt:
            self.clock.restart(step)

    def save_on_stop(self, step: int) -> None:
        """The steps run so far saved, where they are not already (a stop signal)."""
        if self.hooks.save_checkpoint is not None and self.saved_at != step:
            t_save = time.perf_counter()
            self.hooks.save_checkpoint(step)
            self.clock.overhead += time.perf_counter() - t_save


def train_loop(
    step_fn: Callable[[int, torch.Tensor, torch.Tensor, bool], tuple[torch.Tensor, torch.Tensor | None]],
    optimizer: torch.optim.Optimizer,
    batches: Iterator[tuple[torch.Tensor, torch.Tensor]],
    steps: int,
    device: torch.device,
    rate: Throughput,
    hooks: LoopHooks | None = None,
    log_every: int = 1,
    start_step: int = 0,
    nonfinite: str = "fail",
) -> LoopResult:
    """Run `steps` optimizer steps: `step_fn(step, inputs, targets, read)` is one (Trainer.run_step)
    and returns (loss, grad norm) as device tensors, the norm None when the step is not read (`read`
    false: neither logged nor checkpointed nor last) and nothing needs it; `optimizer` is read for
    the learning rate it used.
    A logged step's figures are read after the next step is queued (Readback), so reading them
    never leaves the device idle; a checkpoint step and the last one are read at once (StepClock
    says how the time is counted). Steps count from 0: `start_step` is the first one run, a
    checkpoint after N steps resumes at N. A stop signal (LoopHooks.stop_due) saves the steps run
    so far and ends the loop."""
    hooks = hooks or LoopHooks()
    clock = StepClock(device, start_step)
    reads = _Reads(clock, rate, hooks, nonfinite, start_step)
    skipped: list[int] = []
    pending: tuple[int, Readback, float | None, bool] | None = None  # a logged step not yet read
    stopped_by = stopped_at = 0
    for step in range(start_step, steps):
        stopped_by = hooks.stop_due() if hooks.stop_due is not None else 0
        if stopped_by:
            stopped_at = step
            if pending is not None:
                reads.record(*pending)
                pending = None
            reads.save_on_stop(step)
            break
        t_queue = time.perf_counter()
        ckpt = hooks.checkpoint_due(step + 1)
        read = not (step + 1) % log_every or step == steps - 1 or ckpt
        inputs, targets = next(batches)
        try:
            loss, norm = step_fn(step, inputs, targets, read)
            clock.queued_s += time.perf_counter() - t_queue
        except BaseException:
            if pending is not None:  # the last step that finished is still logged before the error
                with contextlib.suppress(Exception):
                    reads.record(*pending)
            raise
        if pending is not None:  # the previous logged step, read now that this one is queued behind it
            reads.record(*pending)
            pending = None
        # train_step already synced on the norm to decide; reading it again costs no device time.
        if nonfinite == "skip" and not bool(torch.isfinite(norm)):
            skipped.append(step)
            if not dist.is_initialized() or dist.get_rank() == 0:
                log.warning("step %d: non-finite loss or gradient norm; its optimizer update is skipped (train.nonfinite=skip)", step)
        if not read:
            continue  # no sync: the device runs ahead until the next logged step
        readback = Readback(loss, norm, peak_memory_gb(device))
        lr = optimizer.param_groups[0]["lr"] if optimizer.param_groups else None
        if ckpt or step == steps - 1 or readback.event is None:
            reads.record(step, readback, lr, ckpt)  # a checkpoint is of this step's weights, checked first; on a CPU the step is done already
        else:
            pending = (step, readback, lr, ckpt)
    return LoopResult(reads.results, clock.overhead, time.perf_counter() - clock.start, skipped, stopped_by, stopped_at)


def _skipped(result: LoopResult) -> dict:
    return {"skipped_steps": len(result.skipped), "skipped_at": list(result.skipped)}


def _extremes(name: str, values) -> dict[str, float | None]:
    """A curve's min and max beside its last value and median (columns of the MLflow runs table);
    a non-finite value (a skipped step's loss) is left out."""
    finite = [v for v in values if v is not None and math.isfinite(v)]
    return {f"{name}_min": min(finite, default=None), f"{name}_max": max(finite, default=None)}


def summarize(result: LoopResult, untimed_steps: int) -> dict[str, float | None]:
    """Headline figures: medians over the steps after the untimed first ones (allocator warm-up,
    compilation; all steps when the run is shorter)."""
    if not result.steps:  # resumed from a checkpoint that already covers train.steps
        return {"steps": 0, "final_loss": None, "initial_loss": None, "final_grad_norm": None, "tokens_per_s": None,
                "tokens_per_s_per_device": None, "mfu": None, "step_time_s": None, "peak_mem_gb": None,
                "peak_mem_reserved_gb": None, "overhead_frac": 0.0, "wall_s": result.wall_s, "host_rss_mb": None,
                "host_rss_growth_mb": None, "host_step_time_s": None, **_extremes("loss", ()),
                **_extremes("tokens_per_s_per_device", ()), **_skipped(result)}
    steady = result.steps[untimed_steps:] or result.steps[-1:]  # by position: a resumed run warms up again
    tps_dev = statistics.median(s.tokens_per_s_per_device for s in steady)
    mfus = [s.mfu for s in steady if s.mfu is not None]
    return {
        "steps": len(result.steps),
        "final_loss": result.steps[-1].loss,
        "initial_loss": result.steps[0].loss,
        # the loss over every step; tokens/s over the timed steps, those its median is taken over
        **_extremes("loss", (s.loss for s in result.steps)),
        **_extremes("tokens_per_s_per_device", (s.tokens_per_s_per_device for s in steady)),
        "final_grad_norm": result.steps[-1].grad_norm,
        "tokens_per_s": statistics.median(s.tokens_per_s for s in steady),
        "tokens_per_s_per_device": tps_dev,
        "mfu": statistics.median(mfus) if mfus else None,
        "step_time_s": statistics.median(s.step_time_s for s in steady),
        "host_step_time_s": statistics.median(s.host_step_time_s for s in steady) if steady[0].host_step_time_s is not None else None,
        "peak_mem_gb": max(s.peak_mem_alloc_gb for s in result.steps),
        "peak_mem_reserved_gb": max(s.peak_mem_reserved_gb for s in result.steps),
        "overhead_frac": result.overhead_s / max(result.wall_s, 1e-9),
        "wall_s": result.wall_s,
        # host memory that grows step after step is a leak (fused AdamW over DTensor parameters
        # on torch 2.10/2.11 was reported to): the last step's RSS minus the first timed step's
        "host_rss_mb": result.steps[-1].host_rss_mb,
        "host_rss_growth_mb": result.steps[-1].host_rss_mb - steady[0].host_rss_mb if steady[0].host_rss_mb is not None else None,
        **_skipped(result),
    }
