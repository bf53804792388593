"""A Hydra multirun as one MLflow parent run with a child per job (conf/config.yaml registers this
callback under hydra.callbacks).

on_multirun_start opens the parent and leaves its id in the sweep directory, where each job, in
this process or in a joblib worker, finds it and tags its own run as a child. on_multirun_end
reads the jobs' summary.json files (present even when a job failed or its store was down),
writes the comparison table (CSV, and a PNG bar chart of the sweep's headline metric), ends the
parent with the counts of finished and failed jobs, and exits 1 if any job failed.
"""
from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

log = logging.getLogger("src.sweep")

# The figure a sweep of each task is compared on, and whether higher is better.
HEADLINE = {"train": ("tokens_per_s_per_device", True), "profile": ("tokens_per_s_per_device", True), "diagnose": ("share_memory_bound", False),
            "infer": ("decode_tokens_per_s", True)}
SETTING_COLUMNS = ("model", "sharding", "precision", "backend", "kernels", "data", "world_size", "batch_size_per_device", "seq_len")
FIGURE_COLUMNS = ("tokens_per_s_per_device", "mfu", "peak_mem_gb", "final_loss", "step_time_s", "share_memory_bound",
                  "device_name", "ttft_p50_ms", "ttft_p90_ms", "decode_p50_ms", "decode_p90_ms", "prefill_tokens_per_s",
                  "decode_tokens_per_s", "rel_err", "compile_s")


def collect_jobs(sweep_dir: Path) -> list[dict[str, Any]]:
    """One row per job directory (multirun/DATE/TIME/N/): its overrides, settings, figures, status."""
    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        summary_path = job_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "failed", "error": "no summary.json"}
        overrides_path = job_dir / ".hydra" / "overrides.yaml"
        overrides = [line[2:].strip() for line in overrides_path.read_text().splitlines() if line.startswith("- ")] if overrides_path.exists() else []
        row = {"job": int(job_dir.name), "overrides": " ".join(overrides), "status": summary.get("status", "failed"), "task": summary.get("task", "")}
        row.update({k: summary.get("settings", {}).get(k) for k in SETTING_COLUMNS})
        row.update({k: summary.get(k) for k in FIGURE_COLUMNS})
        row["mlflow_run_id"] = summary.get("mlflow_run_id")
        row["error"] = summary.get("error", "")
        rows.append(row)
    return rows


def write_table(rows: list[dict[str, Any]], path: Path) -> Path:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=list(rows[0].keys()))
        writer.writeheader()
        writer.writerows(rows)
    return path


def plot_headline(rows: list[dict[str, Any]], metric: str, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["overrides"] or f"job {r['job']}" for r in rows]
    values = [r[metric] if isinstance(r.get(metric), (int, float)) else 0.0 for r in rows]
    colors = ["tab:blue" if r["status"] == "finished" else "tab:red" for r in rows]
    fig, ax = plt.subplots(figsize=(max(6, 1.2 * len(rows)), 4.5))
    ax.bar(range(len(rows)), values, color=colors)
    ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(metric)
    ax.set_title(f"sweep: {metric} per job (red: failed)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_latency(rows: list[dict[str, Any]], path: Path) -> Path:
    """task=infer sweeps: time to first token and decode step latency, p50 with the p90 above it, per job."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["overrides"] or f"job {r['job']}" for r in rows]
    fig, axes = plt.subplots(1, 2, figsize=(max(8, 2.4 * len(rows)), 4.5))
    for ax, (name, key) in zip(axes, (("time to first token", "ttft"), ("decode step", "decode"))):
        p50 = [r.get(f"{key}_p50_ms") or 0.0 for r in rows]
        p90 = [max((r.get(f"{key}_p90_ms") or 0.0) - v, 0.0) for r, v in zip(rows, p50)]
        ax.bar(range(len(rows)), p50, label="p50", color="tab:blue")
        ax.bar(range(len(rows)), p90, bottom=p50, label="p90", color="tab:blue", alpha=0.35)
        ax.set_xticks(range(len(rows)), labels, rotation=30, ha="right", fontsize=8)
        ax.set_ylabel("ms")
        ax.set_title(name)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.client = None

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # HydraConfig is not set yet at this point: read the hydra node of `config` itself.
        from src.tracking.mlflow_run import (
            PARENT_RUN_ID_FILE, TrackingUnavailable, check_reachable, experiment_id, experiment_name, resolve_tracking_uri, run_tags,
        )

        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        if not config.tracking.enabled:
            return
        cwd = config.hydra.runtime.cwd
        uri = resolve_tracking_uri(config.tracking.uri, cwd)
        try:
            check_reachable(uri, config.tracking.connect_timeout_s)
        except TrackingUnavailable as err:
            log.warning("%s; the sweep goes on untracked, every job keeps its summary.json", err)
            return
        from mlflow import MlflowClient

        self.client = MlflowClient(tracking_uri=uri)
        name = experiment_name(config)
        exp_id = experiment_id(self.client, name)
        overrides = list(config.hydra.overrides.task)
        tags = run_tags(overrides, config.dist.nproc * config.dist.nnodes, config.backend.name, cwd)
        tags.update({"sweep": "true", "sweep_dir": str(sweep_dir)})
        run = self.client.create_run(exp_id, run_name=f"sweep {' '.join(overrides)}"[:250], tags=tags)
        self.parent_run_id = run.info.run_id
        (sweep_dir / PARENT_RUN_ID_FILE).write_text(self.parent_run_id)
        log.info("sweep parent run %s in experiment '%s'", self.parent_run_id, name)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir) if sweep_dir.exists() else []
        failed = [r for r in rows if r["status"] != "finished"]
        if rows:
            metric, _ = HEADLINE.get(rows[0]["task"] or config.task.name, ("tokens_per_s_per_device", True))
            table = write_table(rows, sweep_dir / "sweep.csv")
            chart = plot_headline(rows, metric, sweep_dir / "sweep.png")
            extra = [plot_latency(rows, sweep_dir / "latency.png")] if (rows[0]["task"] or config.task.name) == "infer" else []
            log.info("sweep: %d jobs, %d finished, %d failed -> %s", len(rows), len(rows) - len(failed), len(failed), table)
            for r in failed:
                log.error("job %d (%s) failed: %s", r["job"], r["overrides"], r["error"])
        if self.client is not None and self.parent_run_id:
            from mlflow.entities import Metric

            if rows:
                self.client.log_artifact(self.parent_run_id, str(table))
                self.client.log_artifact(self.parent_run_id, str(chart))
                for path in extra:
                    self.client.log_artifact(self.parent_run_id, str(path))
            self.client.log_batch(self.parent_run_id, metrics=[Metric("jobs_finished", len(rows) - len(failed), 0, 0), Metric("jobs_failed", len(failed), 0, 0)])
            self.client.set_tag(self.parent_run_id, "jobs", f"{len(rows) - len(failed)} finished, {len(failed)} failed")
            self.client.set_terminated(self.parent_run_id, status="FAILED" if rows and len(failed) == len(rows) else "FINISHED")
        if failed:
            sys.exit(1)
