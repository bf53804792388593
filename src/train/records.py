"""What a training run records beside its figures: the MLflow tracker (rank 0 only; an elastic
restart continues the same run), metrics.jsonl, and kernels=auto's account of its choice."""
from __future__ import annotations

import json
import logging
import os
from dataclasses import replace
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from src.distributed.env import DistEnv
from src.fusion.registry import FusedModel
from src.runtime import RunContext
from src.tracking.mlflow_run import (
    ELASTIC_RUN_FILE,
    RUN_ID_FILE,
    MlflowTracker,
    NullTracker,
    flatten,
    run_identity,
)

log = logging.getLogger("src.train")


def log_auto_choice(cfg: DictConfig, kernels: FusedModel, run_dir: Path | None, tracker) -> None:
    """kernels=auto: say what the diagnosis (or, with none, the timing on this GPU) chose and why, on the
    console and in MLflow (rank 0). The timings come from the AUTO_FILE the launching process wrote
    into `run_dir` before the ranks started (none under an external launcher: nothing was timed)."""
    from src.fusion.choice import AUTO_FILE, MEASURED_ONLY, AutoChoice, choose, read_choice, write_choice

    timed = read_choice(run_dir / AUTO_FILE) if run_dir is not None else None
    measured, why, picks = (timed.measured, timed.reasons, timed.picks) if timed is not None else ({}, {}, {})
    if cfg.kernels.diagnosis:
        choice = replace(choose(Path(cfg.kernels.diagnosis)), measured=measured, reasons=why, picks=picks)
        log.info("kernels=auto from %s (%s): %s", choice.diagnosis, choice.device or "unknown GPU", choice.describe())
    else:  # no diagnosis of this model: preflight timed every fusable op here, and cfg.kernels holds its picks
        device = torch.cuda.get_device_name() if torch.cuda.is_available() else ""
        choice = AutoChoice("", device, {op: [MEASURED_ONLY] for op in measured}, measured, why, picks)
        log.info("kernels=auto from timing on this GPU (%s), no diagnosis: fused %s, ops compiled alone %s, blocks %s", device or "unknown GPU",
                 ", ".join(cfg.kernels.fused) or "none", ", ".join(cfg.kernels.compiled) or "none",
                 "compiled" if cfg.kernels.compile else "eager")
    for op, reasons in choice.ops.items():
        if op == "adamw":  # not a module: auto's pick is the optimizer's kernels
            note = f"  (optim.impl={cfg.optim.impl})"
        else:
            note = "" if kernels.swapped.get(op, 1) else "  (this model has none to swap)"
        log.info("  %s%s <- %s", op, note, "; ".join(reasons))
    for op, ms in choice.measured.items():
        log.info("  measured %s: %s%s", op, ", ".join(f"{k} {v:.3f} ms" for k, v in ms.items()),
                 f"; {choice.reasons[op]}" if op in choice.reasons else "")
    if choice.measured:  # predicted against measured, op by op (src/fusion/explain.py)
        from src.fusion.explain import record

        record(choice, cfg, run_dir, tracker)
    tracker.set_tags({
        "kernels.auto": choice.describe(), "kernels.diagnosis": choice.diagnosis or "none",
        "kernels.auto.fused": ",".join(cfg.kernels.fused) or "none", "kernels.auto.compiled": ",".join(cfg.kernels.compiled) or "none",
        "kernels.auto.compile_blocks": str(bool(cfg.kernels.compile)).lower(),
        "kernels.auto.decided_by": "measurement" if choice.measured else "diagnosis", "kernels.auto.optimizer": str(cfg.optim.impl),
        **{f"kernels.auto.why.{op}": rule for op, rule in choice.reasons.items()},
    })
    # the choice itself is in the params (the flattened config: kernels.fused, kernels.compiled, kernels.compile,
    # optim.impl); the timings are in the file
    if run_dir is not None:
        write_choice(choice, kernels.swapped, run_dir / AUTO_FILE, cfg.kernels)
        tracker.log_artifact(run_dir / AUTO_FILE)


def make_tracker(cfg: DictConfig, ctx: RunContext, env: DistEnv, run_dir: Path | None):
    if not (env.is_main and cfg.tracking.enabled):
        return NullTracker()
    device_name = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else env.device.type
    id_file = run_dir / RUN_ID_FILE if run_dir is not None else None
    # an earlier attempt of this elastic run opened the MLflow run (src/tracking/mlflow_run.py)
    elastic_file = run_dir / ELASTIC_RUN_FILE if run_dir is not None else None
    restarted = (elastic_file is not None and elastic_file.exists() and "TORCHELASTIC_RUN_ID" in os.environ
                 and elastic_file.read_text().strip() == os.environ["TORCHELASTIC_RUN_ID"])
    ident = run_identity(cfg, ctx, env.world_size, device_name)
    continue_id = id_file.read_text().strip() if (restarted and id_file is not None and id_file.exists()) else None
    if continue_id is None and id_file is not None and id_file.exists() and cfg.checkpoint.resume != "none" and _preempted(run_dir):
        # the same run directory after a stop signal saved it (a requeued job, the command again): one MLflow run
        continue_id = id_file.read_text().strip()
    return MlflowTracker(
        uri=ident.uri,
        experiment=ident.experiment,
        run_name=ident.run_name,
        params=flatten(OmegaConf.to_container(cfg, resolve=True)),
        tags=ident.tags,
        run_dir=run_dir,
        parent_run_id=ident.parent_run_id,
        system_metrics_interval_s=cfg.tracking.system_metrics_interval_s if cfg.tracking.system_metrics else 0.0,
        connect_timeout_s=cfg.tracking.connect_timeout_s,
        retry_s=cfg.tracking.retry_s,
        continue_run_id=continue_id,
    )


def _preempted(run_dir: Path) -> bool:
    try:
        return json.loads((run_dir / "summary.json").read_text()).get("status") == "preempted"
    except (OSError, json.JSONDecodeError):
        return False


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
