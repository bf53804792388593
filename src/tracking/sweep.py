"""A Hydra multirun as one MLflow parent run with a child per job (conf/config.yaml registers this
callback under hydra.callbacks).

on_multirun_start opens the parent and leaves its id in the sweep directory, where each job, in
this process or in a joblib worker, finds it and tags its own run as a child. on_multirun_end
reads the jobs' summary.json files (present even when a job failed or its store was down),
writes the comparison table (CSV, a PNG bar chart of the sweep's headline metric, and the charts
its task declares: src/tracking/figures.py), ends the parent with the counts of finished and
failed jobs, and exits 1 if any job failed.

The best job is the one with the best `sweep.objective` (the task's headline figure when empty),
which a searching sweeper (hydra/sweeper=optuna: src/tracking/search.py) also optimizes; Optuna's
optimization_results.yaml joins the parent's files. on_job_end tags each job's run with its
config_hash, by which `sweep.resume=true` skips the jobs that finished (src/tracking/resume.py).
"""
from __future__ import annotations

import csv
import json
import logging
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.runtime import world_label, world_size
from src.tracking.resume import (
    FINISHED_FILE,
    finished_jobs,
    previous_parent,
    supersede,
    sweep_hash,
    tag_job_run,
)
from src.tracking.sweep_plots import SWEEP_PLOTS, plot_headline

log = logging.getLogger("src.sweep")

SETTING_COLUMNS = ("model", "sharding", "precision", "backend", "kernels", "data", "world_size", "batch_size_per_device", "seq_len")


def collect_jobs(sweep_dir: Path, sweep_keys: list[str] | None = None) -> list[dict[str, Any]]:
    """One row per job directory (multirun/DATE/TIME/N/): its name (its MLflow run's), settings, figures, status."""
    from src.tracking.figures import figures_of
    from src.tracking.mlflow_run import default_run_name

    rows = []
    for job_dir in sorted((p for p in sweep_dir.iterdir() if p.is_dir() and p.name.isdigit()), key=lambda p: int(p.name)):
        summary_path = job_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {"status": "failed", "error": "no summary.json"}
        overrides_path = job_dir / ".hydra" / "overrides.yaml"
        overrides = [line[2:].strip() for line in overrides_path.read_text().splitlines() if line.startswith("- ")] if overrides_path.exists() else []
        varying = [o.lstrip("+~") for o in overrides if o.lstrip("+~").split("=", 1)[0] in (sweep_keys or ())]
        config_path = job_dir / ".hydra" / "config.yaml"
        name = default_run_name(OmegaConf.load(config_path), varying) if varying and config_path.exists() else " ".join(varying)
        row = {"job": int(job_dir.name), "run": name or f"job {job_dir.name}", "overrides": varying, "status": summary.get("status", "failed"), "task": summary.get("task", "")}
        row.update({k: summary.get("settings", {}).get(k) for k in SETTING_COLUMNS})
        row["world_size"] = world_label(row["world_size"], summary.get("settings", {}).get("dist_fake", False))
        task = row["task"] or "train"
        declared = figures_of(task)
        row.update({k: summary.get(k) for k in (*declared.shown, *declared.extra)})
        row["mlflow_run_id"] = summary.get("mlflow_run_id")
        row["error"] = summary.get("error", "")
        if summary.get("skipped"):  # sweep.resume: a column only in a resumed sweep's table
            row["skipped"] = summary["skipped"]
        rows.append(row)
    return rows


def write_table(rows: list[dict[str, Any]], path: Path) -> Path:
    """sweep.csv: the columns of the task that ran (a training sweep has no latency columns); a
    setting no job reports (seq_len of an inference sweep) is left out."""
    columns: list[str] = []
    for row in rows:
        columns += [k for k in row if k not in columns]
    columns = [k for k in columns if k != "overrides" and (k not in SETTING_COLUMNS or any(r.get(k) is not None for r in rows))]
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
            for part in r["overrides"]:
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
        self.experiment_id: str | None = None
        self.attempt = 0  # 0 for a new parent; N for its Nth resume (the step of the parent's metrics)

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
        # a searching sweeper's space may sit in hydra.sweeper.params: its keys tell the trials apart too
        searched = [str(k) for k in (OmegaConf.select(config, "hydra.sweeper.params", default=None) or {})]
        self.sweep_keys = [*varying_keys(overrides), *(k for k in searched if k not in varying_keys(overrides))]
        (sweep_dir / SWEEP_KEYS_FILE).write_text("\n".join(self.sweep_keys))
        resume = bool(OmegaConf.select(config, "sweep.resume", default=False))
        # Optuna imports alembic after Hydra set up logging: 7 "setup plugin alembic..." INFO lines otherwise
        logging.getLogger("alembic.runtime.plugins").setLevel(logging.WARNING)
        if not config.tracking.enabled:
            if resume:
                log.warning("sweep.resume=true finds the finished jobs in the MLflow store, and tracking is off: every job runs")
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
        exp_id = self.experiment_id = experiment_id(self.client, name)
        identity = sweep_hash(config)
        if resume and self._resume(exp_id, identity, sweep_dir, name):
            return
        tags = run_tags(overrides, world_size(config), config.backend.name, cwd)
        tags.update({"sweep": "true", "sweep_dir": str(sweep_dir), "sweep_hash": identity})
        run = self.client.create_run(exp_id, run_name=f"sweep {default_run_name(config, overrides)}"[:250], tags=tags)
        self.parent_run_id = run.info.run_id
        (sweep_dir / PARENT_RUN_ID_FILE).write_text(self.parent_run_id)
        log.info("sweep parent run %s in experiment '%s'", self.parent_run_id, name)

    def _resume(self, exp_id: str, identity: str, sweep_dir: Path, experiment: str) -> bool:
        """sweep.resume=true: reopen the last parent of these overrides, and leave its FINISHED
        children's summaries, by config_hash, for the jobs to find. False when there is none."""
        from src.tracking.mlflow_run import PARENT_RUN_ID_FILE, write_json

        parent = previous_parent(self.client, exp_id, identity)
        if parent is None:
            log.info("sweep.resume: no earlier sweep of these overrides in experiment '%s' (sweep_hash %s); every job runs", experiment, identity)
            return False
        self.parent_run_id = parent.info.run_id
        self.attempt = int(parent.data.tags.get("resumes", "0")) + 1
        done, others = finished_jobs(self.client, exp_id, self.parent_run_id)
        write_json(sweep_dir / FINISHED_FILE, done)
        (sweep_dir / PARENT_RUN_ID_FILE).write_text(self.parent_run_id)
        self.client.update_run(self.parent_run_id, status="RUNNING")
        self.client.set_tag(self.parent_run_id, "resumes", str(self.attempt))
        self.client.set_tag(self.parent_run_id, "sweep_dir", str(sweep_dir))
        log.info("sweep.resume: parent run %s (%s) again; %d job(s) finished before are skipped by their config_hash, "
                 "%d earlier run(s) not finished run again, as do jobs never run", self.parent_run_id, parent.info.status, len(done), others)
        return True

    def on_job_end(self, config: DictConfig, job_return: Any, **kwargs: Any) -> None:
        """In the job's own process (any launcher): tag its MLflow run with its config_hash, which
        sweep.resume finds it by. A store that does not answer costs the tag, never the job."""
        if not config.tracking.enabled or OmegaConf.select(config, "hydra.mode", default=None) is None:
            return
        from hydra.types import RunMode

        if config.hydra.mode != RunMode.MULTIRUN:
            return
        from src.tracking.mlflow_run import client_for, resolve_tracking_uri

        try:
            tag_job_run(client_for, resolve_tracking_uri(config.tracking.uri, config.hydra.runtime.cwd),
                        Path(config.hydra.runtime.output_dir), config)
        except Exception as err:
            log.warning("job %s: its run's config_hash tag was not stored (%s: %s); sweep.resume will run it again",
                        config.hydra.job.num, type(err).__name__, str(err).splitlines()[0][:200] if str(err) else "")

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        from src.tracking.figures import best_row, figures_of, headline, left_out, lower_is_better

        sweep_dir = Path(config.hydra.sweep.dir)
        rows = collect_jobs(sweep_dir, self.sweep_keys) if sweep_dir.exists() else []
        failed = [r for r in rows if r["status"] != "finished"]
        task = (rows[0]["task"] if rows else "") or config.task.name
        metric = str(OmegaConf.select(config, "sweep.objective", default="") or "") or headline(task)
        best = best_row(rows, metric)
        skipped = [r for r in rows if r.get("skipped")]
        results = sweep_dir / "optimization_results.yaml"  # a searching sweeper's own summary (Optuna's best params and value)
        if rows:
            table = write_table(rows, sweep_dir / "sweep.csv")
            chart = plot_headline(rows, metric, sweep_dir / "sweep.png", best)
            extra = [SWEEP_PLOTS[name](rows, sweep_dir / f"{name}.png") for name in figures_of(task).sweep_plots]
            log.info("sweep: %d jobs, %d finished, %d failed -> %s", len(rows), len(rows) - len(failed), len(failed), table)
            for r in failed:
                log.error("job %d (%s) failed: %s", r["job"], r["run"], r["error"])
            for r in rows:  # finished, but its task's rule keeps it from being the best (a quality bound)
                if id(r) in (out := left_out(rows)):
                    log.info("job %d (%s) left out of the ranking: %s", r["job"], r["run"], out[id(r)])
            if skipped:
                log.info("sweep.resume: %d job(s) skipped, finished before: %s", len(skipped), "; ".join(f"job {r['job']} ({r['run']})" for r in skipped))
        if self.client is not None and self.parent_run_id:
            from mlflow.entities import Metric

            if rows:
                for path in (table, chart, *extra, *([results] if results.exists() else [])):
                    self.client.log_artifact(self.parent_run_id, str(path))
            # a resumed parent's figures again, one step on: each attempt's counts stay in its history
            step = self.attempt
            metrics = [Metric("jobs_finished", len(rows) - len(failed), 0, step), Metric("jobs_failed", len(failed), 0, step)]
            if best is not None:  # the best job's figures under the children's names: one chart column holds all
                figures = dict.fromkeys((*figures_of(task).shown, metric))
                metrics += [Metric(f"summary.{k}", float(best[k]), 0, step) for k in figures if isinstance(best.get(k), (int, float))]
                self.client.set_tag(self.parent_run_id, "best_job", f"{best['run']} ({metric} {best[metric]:.4g})")
                if best.get("mlflow_run_id"):
                    self.client.set_tag(self.parent_run_id, "best_run_id", best["mlflow_run_id"])
            self.client.set_tag(self.parent_run_id, "objective", f"{metric} ({'lower' if lower_is_better(metric) else 'higher'} is better)")
            self.client.log_batch(self.parent_run_id, metrics=metrics)
            self._log_params(parent_params(rows, self.sweep_keys))
            if self.attempt and self.experiment_id:
                for line in supersede(self.client, self.experiment_id, self.parent_run_id):
                    log.info("sweep.resume: %s", line)
            done = f"{len(rows) - len(failed)} finished, {len(failed)} failed" + (f" ({len(skipped)} skipped: finished before)" if skipped else "")
            self.client.set_tag(self.parent_run_id, "jobs", done)
            self.client.set_terminated(self.parent_run_id, status="FAILED" if rows and len(failed) == len(rows) else "FINISHED")
        if rows:
            from src.tracking.ui_view import sweep_hint

            uri = "" if self.client is None else f" --uri {config.tracking.uri}" * (config.tracking.uri != "sqlite:///mlflow.db")
            # a resumed parent keeps its first start time, so `latest` may name a sweep started since
            which = self.parent_run_id if self.attempt and self.parent_run_id else "latest"
            log.info("compare the jobs: python -m src.compare --sweep %s%s", which, uri)
            if self.client is not None:
                # the children side by side, sorted on the figure the best job was picked on (src/tracking/ui_view.py)
                log.info("MLflow: the sweep is run %s, its jobs are its children; %s", self.parent_run_id[:8],
                         sweep_hint(self.client, self.parent_run_id, task, metric, config.tracking.uri))
        if failed:
            sys.exit(1)

    def _log_params(self, params: dict[str, str]) -> None:
        """The parent's params; MLflow keeps a param's first value, so a resumed parent whose sweep
        took other values (more Optuna trials) keeps the first and says so at debug level."""
        from mlflow.entities import Param

        try:
            self.client.log_batch(self.parent_run_id, params=[Param(k, v) for k, v in params.items()])
        except Exception:
            for k, v in params.items():
                try:
                    self.client.log_param(self.parent_run_id, k, v)
                except Exception as err:
                    log.debug("parent param %s kept its first value (%s)", k, err)
