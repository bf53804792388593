"""task=diagnose: one training step of the configured model under Nsight Compute, then the verdicts.

The step runs in a child process (`python -m src.diagnose.target CONFIG`) on one GPU, with
NVTX ranges per module and around loss, backward and optimizer; ncu records only that step
(`--profile-from-start off` with cudaProfilerStart/Stop around it) and, with `--nvtx`, the
ranges open at each launch, so every kernel maps back to the module that launched it. The report
is exported as a raw CSV (which needs nothing but ncu to read) and diagnosed.
"""
from __future__ import annotations

import glob
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from src.config.compose import ConfigError

log = logging.getLogger("src.diagnose")

NO_GPU = (
    "task=diagnose runs Nsight Compute (ncu), which needs an NVIDIA GPU and backend=cuda; on this machine "
    "diagnose an existing report with `python -m src.diagnose REPORT` (or diagnose.report=REPORT), "
    "or trace the step with +exp=profile"
)


def find_ncu(explicit: str = "") -> str | None:
    if explicit:
        return explicit if os.path.isfile(explicit) else None
    found = shutil.which("ncu")
    if found:
        return found
    candidates = sorted(glob.glob("/opt/nvidia/nsight-compute/*/ncu") + glob.glob("/usr/local/cuda*/bin/ncu"), reverse=True)
    return candidates[0] if candidates else None


def target_config(cfg: DictConfig) -> DictConfig:
    """The child's config: the same run as a single-rank train task that marks step `diagnose.step`."""
    child = OmegaConf.create(OmegaConf.to_container(cfg, resolve=True))
    with open_dict(child):
        child.task.name = "train"
        child.tracking.enabled = False
        child.dist.nproc = 1
        child.dist.nnodes = 1
        child.train.steps = cfg.diagnose.step + 1
        child.train.progress = False
        child.train.seed_line = False
        child.profile.nvtx = True
        child.profile.nvtx_step = cfg.diagnose.step
    return child


def ncu_command(ncu: str, cfg: DictConfig, report_base: Path, target_yaml: Path, child_dir: Path) -> list[str]:
    cmd = [ncu, "--clock-control", "none", "--profile-from-start", "off", "--nvtx", "--target-processes", "all", "-f", "-o", str(report_base)]
    for section in cfg.diagnose.sections:
        cmd += ["--section", section]
    if cfg.diagnose.launch_count > 0:
        cmd += ["--launch-count", str(cfg.diagnose.launch_count)]
    return cmd + [sys.executable, "-m", "src.diagnose.target", str(target_yaml), str(child_dir)]


def run_ncu(cfg: DictConfig, out: Path) -> Path:
    """Profile one step; returns the raw CSV export of the report."""
    ncu = find_ncu(cfg.diagnose.ncu)
    if ncu is None:
        raise ConfigError("ncu (Nsight Compute) was not found on PATH or under /opt/nvidia/nsight-compute; install it, or set diagnose.ncu=PATH")
    target_yaml = out / "target.yaml"
    target_yaml.write_text(OmegaConf.to_yaml(target_config(cfg)))
    report_base = out / "report"
    cmd = ncu_command(ncu, cfg, report_base, target_yaml, out / "target")
    log.info("profiling step %d under ncu: %s", cfg.diagnose.step, " ".join(cmd))
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
    with open(out / "ncu.log", "w") as ncu_log:
        proc = subprocess.run(cmd, stdout=ncu_log, stderr=subprocess.STDOUT, timeout=cfg.diagnose.timeout_s, env=env)
    if proc.returncode != 0 or not report_base.with_suffix(".ncu-rep").exists():
        tail = (out / "ncu.log").read_text(errors="replace").strip().splitlines()[-5:]
        raise RuntimeError(f"ncu exited with {proc.returncode}; see {out / 'ncu.log'}: {' | '.join(tail)}")
    csv_path = out / "report_raw.csv"
    with open(csv_path, "w") as f:
        subprocess.run([ncu, "--import", str(report_base.with_suffix(".ncu-rep")), "--csv", "--page", "raw"], stdout=f, check=True)
    return csv_path


def run_diagnose(cfg: DictConfig, ctx) -> dict[str, Any]:
    """ncu over one step (or diagnose.report), then the diagnosis; src/tasks.py's one_shot has
    written config.yaml (which kernels=auto matches a diagnosis's model by) and opened run.log."""
    from src.diagnose.cli import diagnose_report
    from src.profiling.classify import Thresholds
    from src.tracking.mlflow_run import task_tracker, write_json

    out = Path(ctx.run_dir) / "diagnose"
    out.mkdir(parents=True, exist_ok=True)
    report = Path(cfg.diagnose.report) if cfg.diagnose.report else run_ncu(cfg, out)
    # Only the profiled step is captured, and its forward, loss and optimizer run inside NVTX
    # ranges of the main thread: a kernel with no range open came from the autograd thread.
    unranged = "backward" if not cfg.diagnose.report else ""
    result = diagnose_report(report, out, Thresholds(**OmegaConf.to_container(cfg.diagnose.classifier)), unranged)
    log.info("diagnosis of %d kernels (%.3f ms), memory-bound %.1f%% of kernel time:\n%s",
             result["kernel_count"], 1e3 * result["total_kernel_time_s"], 100 * result["share_memory_bound"],
             (out / "top_ops.md").read_text())
    summary = {
        "task": "diagnose", "status": "finished", "report": str(report),
        "diagnosis": str(out / "diagnosis.json"), "device": result["device"],
        "kernel_count": result["kernel_count"], "kernel_time_s": result["total_kernel_time_s"],
        "share_memory_bound": result["share_memory_bound"], "share_by_bound": result["share_by_bound"],
        "share_by_category": result["share_by_category"],
        "fusable": sorted({o["fusion"] for o in result["ops"] if o["fusion"]}),
        "mlflow_run_id": None,
    }
    tracker = task_tracker(cfg, ctx, result["device"])
    summary["mlflow_run_id"] = tracker.run_id
    for name in ("diagnosis.json", "roofline.png", "top_ops.md"):
        tracker.log_artifact(out / name, "diagnose")
    tracker.finish("FINISHED", {"share_memory_bound": result["share_memory_bound"], "kernel_time_s": result["total_kernel_time_s"],
                                **{f"share_{k.replace('-', '_')}": v for k, v in result["share_by_bound"].items()}})
    write_json(Path(ctx.run_dir) / "summary.json", summary)
    return summary
