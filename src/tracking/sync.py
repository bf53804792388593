"""`python -m src.tracking.sync RUN_DIR [RUN_DIR ...] [--uri URI]`: store in MLflow what a run's
store did not take: a server down at the run's end, or from its start.

Such a run leaves `.mlflow_unsynced.json` (src/tracking/mlflow_run.py: the store's URI, the run's
id if it was made, its name, tags, params and end status). The sync makes the run if it was never
made, logs the step metrics of metrics.jsonl that the store lacks (each (metric, step) once, however
often it runs), the summary's figures, the run's files and tags, and ends the run with the status
it ended with; then it deletes the file. Run it again after a failure: it does only what is left.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from src.tracking.mlflow_run import RUN_ARTIFACTS, RUN_ID_FILE, UNSYNCED_FILE, experiment_id, write_json

_MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch


class SyncError(RuntimeError):
    pass


def _steps(run_dir: Path) -> list[dict[str, Any]]:
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _ensure_run(client, record: dict[str, Any], run_dir: Path) -> str:
    """The run's id: the one the run made, or a run made now as the run would have made it."""
    from mlflow.entities import Param
    from mlflow.exceptions import MlflowException

    if record.get("run_id"):
        try:
            client.get_run(record["run_id"])
            return record["run_id"]
        except MlflowException:
            pass  # not in this store (another --uri): made here
    tags = dict(record.get("tags") or {})
    if record.get("parent_run_id"):
        tags["mlflow.parentRunId"] = record["parent_run_id"]
    run_id = client.create_run(experiment_id(client, record["experiment"]), run_name=record["run_name"], tags=tags).info.run_id
    params = [Param(k, v) for k, v in (record.get("params") or {}).items()]
    for i in range(0, len(params), 100):  # MLflow's limit on params per log_batch
        client.log_batch(run_id, params=params[i : i + 100])
    record["run_id"] = run_id
    write_json(run_dir / UNSYNCED_FILE, record)  # a second sync after a failure uses this run
    (run_dir / RUN_ID_FILE).write_text(run_id)
    return run_id


def _missing_metrics(client, run_id: str, steps: list[dict[str, Any]], summary: dict[str, Any]) -> list:
    from mlflow.entities import Metric

    now = int(time.time() * 1000)
    wanted: dict[str, dict[int, float]] = {}
    for row in steps:
        for key, value in row.items():
            if key != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                wanted.setdefault(key, {})[int(row["step"])] = float(value)
    for key, value in summary.items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            wanted[f"summary.{key}"] = {0: float(value)}
    missing = []
    for key, values in wanted.items():
        have = {m.step for m in client.get_metric_history(run_id, key)}
        missing += [Metric(key, v, now, step) for step, v in values.items() if step not in have]
    return missing


class NotARunFolder(SyncError):
    """A path that is not a run's folder, or a run's record that cannot be read: the command's input is wrong."""


def sync_run(run_dir: Path, uri: str | None = None) -> str:
    """Store what `run_dir`'s MLflow run lacks; returns the line that says what was done."""
    from src.tracking.mlflow_run import client_for

    marker = run_dir / UNSYNCED_FILE
    if not run_dir.is_dir():
        raise NotARunFolder(f"{run_dir}: no such run directory")
    if not marker.exists():
        if not any((run_dir / name).exists() for name in ("summary.json", "config.yaml", ".hydra")):
            raise NotARunFolder(f"{run_dir}: not a run's folder (no summary.json, config.yaml or .hydra/ in it); "
                            "give the folder a run printed, e.g. outputs/DATE/TIME")
        return f"{run_dir}: nothing to store (no {UNSYNCED_FILE}: its MLflow record is complete)"
    try:
        record = json.loads(marker.read_text())
        uri = uri or record["uri"]
    except (json.JSONDecodeError, UnicodeDecodeError, KeyError, TypeError) as err:
        raise NotARunFolder(f"{marker}: cut off or not this project's ({type(err).__name__}: {err}); the run's figures are in "
                        f"{run_dir / 'summary.json'} and metrics.jsonl") from None
    client = client_for(uri)  # and MLflow's own "View run" lines kept off the console
    try:
        run_id = _ensure_run(client, record, run_dir)
        summary_path = run_dir / "summary.json"
        summary = json.loads(summary_path.read_text()) if summary_path.exists() else {}
        metrics = _missing_metrics(client, run_id, _steps(run_dir), summary)
        for i in range(0, len(metrics), _MAX_BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + _MAX_BATCH])
        for key, value in (record.get("tags") or {}).items():
            client.set_tag(run_id, key, value)
        if record.get("error"):
            client.set_tag(run_id, "error", record["error"][:5000])
        for name in RUN_ARTIFACTS:
            if (run_dir / name).exists():
                client.log_artifact(run_id, str(run_dir / name))
        client.set_terminated(run_id, status=record["status"])
    except Exception as err:
        first = (str(err).splitlines() or [""])[0][:200]
        raise SyncError(f"{run_dir}: MLflow at {uri} did not take the run ({type(err).__name__}: {first}); "
                        "nothing is lost: run the sync again once it answers") from None
    marker.unlink()
    return f"{run_dir}: {len(metrics)} metric values stored, run {run_id[:8]} ended {record['status']} at {uri}"


def main(argv: list[str] | None = None) -> int:
    import os

    os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")  # a server still down: say so now, not after minutes
    os.environ.setdefault("MLFLOW_HTTP_REQUEST_TIMEOUT", "30")
    parser = argparse.ArgumentParser(prog="python -m src.tracking.sync", description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dirs", nargs="+", type=Path, help="run directories (outputs/DATE/TIME, multirun/DATE/TIME/N)")
    parser.add_argument("--uri", help="store them here instead of the store the run used")
    args = parser.parse_args(argv)
    failed = code = 0
    for run_dir in args.run_dirs:
        try:
            print(sync_run(run_dir, args.uri))
        except SyncError as err:
            print(f"error: {err}", file=sys.stderr)
            failed += 1
            code = 2 if isinstance(err, NotARunFolder) else max(code, 1)  # a wrong folder: 2, as a wrong setting is
    return code


if __name__ == "__main__":
    sys.exit(main())
