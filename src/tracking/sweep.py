"""A Hydra multirun as one MLflow parent run with a child per job (conf/config.yaml registers this
callback under hydra.callbacks).

on_multirun_start opens the parent and leaves its id in the sweep directory, where each job, in
this process or in a joblib worker, finds it and tags its own run as a child. on_multirun_end
reads the jobs' summary.json files (present even when a job failed or its store was down),
writes the comparison table (CSV, a PNG bar chart of the sweep's headline metric, and the charts
its task declares: src/tracking/figures.py), ends the parent with the counts of finished and
failed jobs, and exits 1 if any job failed.
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

from src.runtime import world_label, world_size
from src.tracking.sweep_plots import SWEEP_PLOTS, plot_headline

log = logging.getLogger("src.sweep")

SETTING_COLUMNS = ("model", "sharding", "precision", "backend", "kernels", "data", "world_size", "batch_size_per_device", "seq_len")


def collect_jobs(sweep_dir: Path, sweep_keys: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per job directory (multirun/DATE/TIME/N/): its name, settings, figures, status."""
    from src.tracking.figures import figures_of

    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        summary_path = job_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "failed", "error": "no summary.json"}
        overrides_path = job_dir / ".hydra" / "overrides.yaml"
        overrides = [line[2:].strip() for line in overrides_path.read_text().splitlines() if line.startswith("- ")] if overrides_path.exists() else []
        varying = [o.lstrip("+~") for o in overrides if o.lstrip("+~").split("=", 1)[0] in (sweep_keys or ())]
        row = {"job": int(job_dir.name), "run": " ".join(varying) or f"job {job_dir.name}", "status": summary.get("status", "failed"), "task": summary.get("task", "")}
        row.update({k: summary.get("settings", {}).get(k) for k in SETTING_COLUMNS})
        row["world_size"] = world_label(row["world_size"], summary.get("settings", {}).get("dist_fake", False))
        task = row["task"] or "train"
        declared = figures_of(task)
        row.update({k: summary.get(k) for k in (*declared.shown, *declared.extra)})
        row["mlflow_run_id"] = summary.get("mlflow_run_id")
        row["error"] = summary.get("error", "")
        rows.append(row)
    return rows


def write_table(rows: list[dict[str, Any]], path: Path) -> Path:
    """sweep.csv: the columns of the task that ran (a training sweep has no latency columns); a
    setting no job reports (seq_len of an inference sweep) is left out."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    columns = [k for k in columns if k not in SETTING_COLUMNS or any(r.get(k) is not None for r in rows)]
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
        writer.writeheader()
        writer.writerows(rows)
    return path


def parent_params(rows: list[dict[str, Any]], sweep_keys: list[str]) -> dict[str, str]:
    """The parent run's params: each varied key with the values the jobs took, under the name the
    children's params use (`precision` -> `precision.name`), so the runs table lines them up."""
    from src.config import GROUPS

    params = {}
    for key in sweep_keys:
        values = []
        for r in rows:
            for part in r["run"].split():
                k, _, v = part.partition("=")
                if k == key and v not in values:
                    values.append(v)
        params[f"{key}.name" if key in GROUPS else key] = ",".join(values)[:6000]
    return params


class MlflowSweepCallback(Callback):
    def __init__(self) -> None:
        self.parent_run_id: str | None = None
        self.client = None
        self.sweep_keys: list[str] = []

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        # HydraConfig is not set yet at this point: read the hydra node of `config` itself.
        from src.tracking.mlflow_run import (
            PARENT_RUN_ID_FILE,
            SWEEP_KEYS_FILE,
            TrackingUnavailable,
            check_reachable,
            default_run_name,
            experiment_id,
            experiment_name,
            resolve_tracking_uri,
            run_tags,
            varying_keys,
        )

        sweep_dir = Path(config.hydra.sweep.dir)
        sweep_dir.mkdir(parents=True, exist_ok=True)
        overrides = list(config.hydra.overrides.task)
        self.sweep_keys = varying_keys(overrides)
        (sweep_dir / SWEEP_KEYS_FILE).write_text("\n".join(self.sweep_keys))
        if not config.tracking.enabled:
            return
        cwd = config.hydra.runtime.cwd
        uri = resolve_tracking_uri(config.tracking.uri, cwd)
        try:
            check_reachable(uri, config.tracking.connect_timeout_s)
        except TrackingUnavailable as err:
            log.warning("%s; the sweep goes on untracked, every job keeps its summary.json", err)
            return
        from src.tracking.mlflow_run import client_for

        self.client = client_for(uri)
        name = experiment_name(config)
        exp_id = experiment_id(self.client, name)
        tags = run_tags(overrides, world_size(config), config.backend.name, cwd)
        tags.update({"sweep": "true", "sweep_dir": str(sweep_dir)})
        run = self.client.create_run(exp_id, run_name=f"sweep {default_run_name(config, overrides)}"[:250], tags=tags)
        self.parent_run_id = run.info.run_id
        (sweep_dir / PARENT_RUN_ID_FILE).write_text(self.parent_run_id)
        log.info("sweep parent run %s in experiment '%s'", self.parent_run_id, name)

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from src.tracking.figures import best_row, figures_of, headline

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir, self.sweep_keys) if sweep_dir.exists() else []
        failed = [r for r in rows if r["status"] != "finished"]
        task = (rows[0]["task"] if rows else "") or config.task.name
        metric = headline(task)
        best = best_row(rows, metric)
        if rows:
            table = write_table(rows, sweep_dir / "sweep.csv")
            chart = plot_headline(rows, metric, sweep_dir / "sweep.png", best)
            extra = [SWEEP_PLOTS[name](rows, sweep_dir / f"{name}.png") for name in figures_of(task).sweep_plots]
            log.info("sweep: %d jobs, %d finished, %d failed -> %s", len(rows), len(rows) - len(failed), len(failed), table)
            for r in failed:
                log.error("job %d (%s) failed: %s", r["job"], r["run"], r["error"])
        if self.client is not None and self.parent_run_id:
            from mlflow.entities import Metric, Param

            if rows:
                for path in (table, chart, *extra):
                    self.client.log_artifact(self.parent_run_id, str(path))
            metrics = [Metric("jobs_finished", len(rows) - len(failed), 0, 0), Metric("jobs_failed", len(failed), 0, 0)]
            if best is not None:  # the best job's figures under the children's names: one chart column holds all
                metrics += [Metric(f"summary.{k}", float(best[k]), 0, 0) for k in figures_of(task).shown if isinstance(best.get(k), (int, float))]
                self.client.set_tag(self.parent_run_id, "best_job", f"{best['run']} ({metric} {best[metric]:.4g})")
            params = [Param(k, v) for k, v in parent_params(rows, self.sweep_keys).items()]
            self.client.log_batch(self.parent_run_id, metrics=metrics, params=params)
            self.client.set_tag(self.parent_run_id, "jobs", f"{len(rows) - len(failed)} finished, {len(failed)} failed")
            self.client.set_terminated(self.parent_run_id, status="FAILED" if rows and len(failed) == len(rows) else "FINISHED")
        if rows:
            from src.tracking.mlflow_run import ui_hint

            uri = "" if self.client is None else f" --uri {config.tracking.uri}" * (config.tracking.uri != "sqlite:///mlflow.db")
            log.info("compare the jobs: python -m src.compare --sweep latest%s", uri)
            if self.client is not None:
                log.info("MLflow: the sweep is run %s, its jobs are its children; %s", self.parent_run_id[:8], ui_hint(config.tracking.uri))
        if failed:
            sys.exit(1)
