"""cfg.task.name -> the function that runs it. Each takes the composed config and the RunContext,
goes through task_wrapper (its failure recorded once) and returns its summary."""
from __future__ import annotations

import functools
import logging
import signal
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

# each task package declares its figures (src/tracking/figures.py) when imported: sweeps and
# src.compare read them in this process
import src.diagnose  # noqa: F401
import src.edge  # noqa: F401
import src.kernel_bench  # noqa: F401
import src.train  # noqa: F401
from src.distributed.env import launched_as_worker
from src.runtime import RunContext, save_resolved_config, setup_logging

log = logging.getLogger("src.run")


def failure_message(err: BaseException) -> str:
    """The one line a failed job is recorded and reported with: a RankFailed's own (the rank's
    error as the launcher read it), else the exception's type and message."""
    from src.distributed.launch import RankFailed

    return str(err) if isinstance(err, RankFailed) else f"{type(err).__name__}: {err}"


def interruption(err: BaseException) -> str:
    """`interrupted by SIGTERM`: the signal a SignalException carries, SIGINT for a Ctrl-C."""
    return f"interrupted by {getattr(getattr(err, 'sigval', None), 'name', 'SIGINT')}"


def task_wrapper(run: Callable[[DictConfig, RunContext], Any]) -> Callable[[DictConfig, RunContext], Any]:
    """What every task entry goes through (lightning-hydra-template's task_wrapper): it runs the
    task and returns its summary. On an exception it records the failure, once: summary.json with
    the error and the MLflow run FAILED (KILLED when interrupted), made if the task never opened
    one; then it raises the exception again for run_job to report in one line. A ConfigError met
    at run time is only reported: nothing of the run has started."""

    @functools.wraps(run)
    def task(cfg: DictConfig, ctx: RunContext) -> Any:
        from torch.distributed.elastic.multiprocessing.api import SignalException

        from src.config.compose import ConfigError
        from src.distributed.launch import RankFailed

        try:
            return run(cfg, ctx)
        except (KeyboardInterrupt, SignalException) as err:
            # SignalException is an Exception: the launcher's SIGTERM, recorded as a Ctrl-C is.
            signal.signal(signal.SIGINT, signal.SIG_IGN)  # a second Ctrl-C must not cut the record short
            record_job_failure(cfg, ctx, interruption(err), status="killed")
            raise
        except ConfigError:
            raise
        except Exception as err:
            message = failure_message(err)
            log.error("job failed: %s", message, exc_info=not isinstance(err, RankFailed))
            if isinstance(err, RankFailed) and err.ranks and 0 not in err.ranks:
                # Several nodes, each an agent: rank 0 ran on another node, whose process records the
                # run (its summary.json, its MLflow run); a second record here would be a second run.
                log.error("rank 0 ran on another node, whose record of the run stands")
            else:
                record_job_failure(cfg, ctx, message)
            raise

    return task


@task_wrapper
def run_train(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """task=train and task=profile: in this process for one rank (or dist.fake's rank 0 alone), else through the elastic launcher:
    this node's agent, one of dist.nnodes (a submitit job's nodes meet on its first node)."""
    from src.config.compose import ConfigError
    from src.distributed.cluster import node_log_name, submitit_job
    from src.distributed.launch import launch_ranks
    from src.train.worker import elastic_entry, train

    run_dir = Path(ctx.run_dir) if ctx.run_dir else None
    if run_dir is not None:
        save_resolved_config(cfg, run_dir)
    if launched_as_worker() or cfg.dist.fake or (cfg.dist.nproc == 1 and cfg.dist.nnodes == 1):
        summary = train(cfg, ctx)
        return end_preempted(cfg, summary) if summary.get("status") == "preempted" else summary
    job, endpoint = submitit_job(), cfg.dist.rdzv_endpoint
    if job is not None:
        if job.num_nodes != cfg.dist.nnodes:
            raise ConfigError(f"dist.nnodes={cfg.dist.nnodes} but this job has {job.num_nodes} node(s); let hydra.launcher.nodes follow dist.nnodes (its default)")
        endpoint = endpoint or (job.rendezvous_endpoint if job.num_nodes > 1 else "")
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from src.train.preempt import ForwardToRanks, stop_signals

    try:
        with ForwardToRanks(stop_signals(cfg.checkpoint.on_signal, job is not None), run_dir) as forward:
            results = launch_ranks(
                elastic_entry,
                (OmegaConf.to_container(cfg, resolve=True), asdict(ctx)),
                nproc=cfg.dist.nproc,
                nnodes=cfg.dist.nnodes,
                max_restarts=cfg.dist.max_restarts,
                rdzv_endpoint=endpoint,
                notes_dir=ctx.run_dir,
                log_name=node_log_name(job),
                run_id=f"perflab-job{job.job_id}" if job is not None and job.num_nodes > 1 else "",
                forkserver=cfg.backend.name == "cpu",
                kept_signals=forward.handled,
            )
    except SignalException:
        # torch's agent took a signal (SIGINT, or a stop signal sent twice), sent it to the ranks and
        # waited for them (30 s, then SIGKILL): if they saved and rank 0 recorded the stop, that
        # record is the run's
        summary = _read_summary(run_dir)
        if summary.get("status") != "preempted":
            raise
        return end_preempted(cfg, summary)
    summary = results[min(results)]
    return end_preempted(cfg, summary) if summary.get("status") == "preempted" else summary


def _read_summary(run_dir: Path | None) -> dict[str, Any]:
    import json

    path = run_dir / "summary.json" if run_dir is not None else None
    try:
        return json.loads(path.read_text()) if path is not None and path.exists() else {}
    except json.JSONDecodeError:
        return {}


def end_preempted(cfg: DictConfig, summary: dict[str, Any]) -> None:
    """A run a signal stopped, its checkpoint saved (src/train/preempt.py): a submitit job hands over
    to submitit's requeue (it exits there); a SLURM batch job requeues itself (checkpoint.requeue);
    then the process exits 128 + the signal's number, a sweep on this machine with it."""
    import os

    from src.distributed.cluster import requeue_through, scontrol_requeue, submitit_job
    from src.train.preempt import exit_code, stop_signals

    sig = signal.Signals[summary["preempted_by"]]
    if submitit_job() is not None:
        submitit_sig = stop_signals([sig.name], submitit=True)[-1]
        handler = signal.getsignal(submitit_sig)
        if callable(handler) and getattr(handler, "__name__", "") == "checkpoint_and_try_requeue":
            log.warning("%s: handing over to submitit, which requeues the job", sig.name)
            requeue_through(handler)
            handler(submitit_sig, None)  # submitit requeues the job, then exits
    elif os.environ.get("SLURM_JOB_ID") and os.environ.get("ENVIRONMENT") == "BATCH" and cfg.checkpoint.requeue:
        job_id = os.environ["SLURM_JOB_ID"]
        done = scontrol_requeue(job_id)
        if done.returncode == 0:
            log.warning("%s: SLURM job %s requeued (checkpoint.requeue)", sig.name, job_id)
        else:
            log.warning("%s: `scontrol requeue %s` failed: %s", sig.name, job_id, (done.stderr.strip().splitlines() or [""])[0])
    raise SystemExit(exit_code(sig))


def one_shot(run: Callable[[DictConfig, RunContext], Any]) -> Callable[[DictConfig, RunContext], Any]:
    """The setup every task that runs in this process alone shares (diagnose, kernel_bench, infer):
    its folder, the resolved config.yaml, logging to the console and run.log."""

    @functools.wraps(run)
    def task(cfg: DictConfig, ctx: RunContext) -> Any:
        run_dir = Path(ctx.run_dir)
        save_resolved_config(cfg, run_dir)
        setup_logging(run_dir, 0)
        return run(cfg, ctx)

    return task


@task_wrapper
@one_shot
def run_diagnose(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    from src.diagnose.task import run_diagnose as diagnose

    return diagnose(cfg, ctx)


@task_wrapper
@one_shot
def run_kernel_bench(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    from src.kernel_bench.task import run_kernel_bench as bench

    return bench(cfg, ctx)


@task_wrapper
@one_shot
def run_infer(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    from src.edge.task import run_infer as infer

    return infer(cfg, ctx)


TASKS: dict[str, Callable[[DictConfig, RunContext], Any]] = {
    "train": run_train,
    "profile": run_train,  # the training loop under torch.profiler (src/profiling/torch_profile.py)
    "diagnose": run_diagnose,
    "kernel_bench": run_kernel_bench,
    "infer": run_infer,
}


def run_task(cfg: DictConfig, ctx: RunContext) -> Any:
    return TASKS[cfg.task.name](cfg, ctx)


def record_job_failure(cfg: DictConfig, ctx: RunContext, message: str, status: str = "failed") -> None:
    """summary.json with the error, and the MLflow run FAILED (or KILLED): made if rank 0 never
    opened one, ended if rank 0 died with it open."""
    from src.runtime import settings, world_size
    from src.tracking.mlflow_run import record_failed_run, run_identity, write_json

    if ctx.run_dir is None:
        return
    from src.distributed.cluster import submitit_job

    job = submitit_job()
    if job is not None and job.node != 0 and not launched_as_worker():
        # a submitit job's nodes share its folder: the first node's process records the job
        log.error("node %d of the job: %s (the job's record is the first node's)", job.node, message)
        return
    run_dir = Path(ctx.run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    write_json(run_dir / "summary.json", {"task": cfg.task.name, "status": status, "error": message, "settings": settings(cfg, world_size(cfg))})
    if not cfg.tracking.enabled:
        return
    ident = run_identity(cfg, ctx, world_size(cfg), cfg.backend.name)
    tags = dict(ident.tags, **({"mlflow.parentRunId": ident.parent_run_id} if ident.parent_run_id else {}))
    try:
        record_failed_run(ident.uri, ident.experiment, ident.run_name, message, tags, run_dir, status="KILLED" if status == "killed" else "FAILED")
    except Exception as err:  # the store itself is down: the summary above still holds the error
        log.warning("could not record the failure in MLflow: %s", err)
