"""sweep.resume=true: the same -m command again runs only what the last attempt did not finish.

Each job's MLflow run carries a tag `config_hash`: a hash of the job's composed config without
`tracking` (where it is recorded), `sweep` (how the sweep is judged and resumed) and Hydra's own
node (where and how it is launched), so one config has one hash whatever the launcher, the sweep's
folder or the attempt. The sweep's parent run carries `sweep_hash`, of the command's overrides less
the same plumbing (and of the sweeper's search space), so the same command finds its parent again.

On resume the callback (src/tracking/sweep.py) reopens the newest parent with that sweep_hash,
and writes the summaries of its FINISHED children, by config_hash, into the new sweep folder
(FINISHED_FILE). A job whose hash is there does not run: it writes that summary (marked
`skipped`) into its folder, says so in the log, and hands it back, so the sweep's table, best job
and an Optuna study see it as before. The failed, killed and missing jobs run, as children of the
same parent; at the end each config keeps one child (the FINISHED one), and the runs it
superseded are tagged `superseded_by` and deleted (MLflow keeps them: `mlflow runs restore`).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("src.sweep")

FINISHED_FILE = ".sweep_finished.json"  # config_hash -> the FINISHED child's id, name and summary, for the jobs
# Left out of a job's hash: where the run is recorded, how the sweep is judged and resumed, and
# Hydra's node (folders, launcher, the job's number); none of them changes what the job computes.
PLUMBING = ("hydra", "tracking", "sweep")


def config_hash(cfg: DictConfig) -> str:
    """16 hex digits (64 bits: a collision among a sweep's jobs is out of reach) of the job's
    config, unresolved (`${now:}` stays its text, the same on every attempt), keys sorted."""
    tree = OmegaConf.to_container(cfg, resolve=False, enum_to_str=True)
    for key in PLUMBING:
        tree.pop(key, None)
    text = json.dumps(tree, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _is_sweep_plumbing(override: str) -> bool:
    key = override.lstrip("+~").split("=", 1)[0]
    if key.startswith(("hydra/sweeper", "hydra.sweeper.params")):
        return False  # what is searched is the sweep's identity
    return key.startswith(("hydra", "tracking.", "sweep."))


def sweep_hash(config: DictConfig) -> str:
    """The sweep's identity: its overrides (order aside) and its sweeper's search space, without
    the launcher, the folders, tracking.*, sweep.* or the sweeper's trial count and seed (so a
    resumed Optuna sweep may ask for more trials)."""
    overrides = sorted(o for o in OmegaConf.to_container(config.hydra.overrides.task) if not _is_sweep_plumbing(o))
    params = OmegaConf.select(config, "hydra.sweeper.params", default=None)
    space = sorted(f"{k}={v}" for k, v in (params or {}).items())
    target = str(OmegaConf.select(config, "hydra.sweeper._target_", default=""))
    text = json.dumps([target, overrides, space])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def previous_parent(client, experiment_id: str, sweep_id: str):
    """The newest sweep parent run of these overrides in the experiment, or None."""
    runs = client.search_runs([experiment_id], f"tags.sweep_hash = '{sweep_id}' and tags.sweep = 'true'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    return runs[0] if runs else None


def children(client, experiment_id: str, parent_run_id: str) -> list:
    return client.search_runs([experiment_id], f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=5000)


def _summary_of(client, run) -> dict[str, Any]:
    """The child's summary.json as it logged it (an artifact of every finished task); else its
    summary.* metrics, which hold the figures."""
    os.environ.setdefault("MLFLOW_ENABLE_ARTIFACTS_PROGRESS_BAR", "false")  # a bar per job on the sweep's console otherwise
    try:
        with tempfile.TemporaryDirectory() as tmp:
            return json.loads(Path(client.download_artifacts(run.info.run_id, "summary.json", tmp)).read_text())
    except Exception:  # a task that logs no summary.json, artifacts kept elsewhere
        figures = {k[len("summary."):]: v for k, v in run.data.metrics.items() if k.startswith("summary.")}
        return {"task": run.data.params.get("task.name", ""), "status": "finished", **figures}


def finished_jobs(client, experiment_id: str, parent_run_id: str) -> tuple[dict[str, dict[str, Any]], int]:
    """{config_hash: {run_id, run_name, summary}} of the parent's FINISHED children, and how many
    other children (failed, killed, still marked running, or with no hash) will run again."""
    done: dict[str, dict[str, Any]] = {}
    others = 0
    for run in sorted(children(client, experiment_id, parent_run_id), key=lambda r: r.info.start_time or 0):
        h = run.data.tags.get("config_hash")
        if run.info.status == "FINISHED" and h:
            done[h] = {"run_id": run.info.run_id, "run_name": run.info.run_name, "summary": _summary_of(client, run)}
        else:
            others += 1
    return done, others


def finished_before(cfg: DictConfig, sweep_dir: str | Path, output_dir: str | Path, job_num: Any) -> dict[str, Any] | None:
    """In a job of a resumed sweep: the summary of the FINISHED run of this very config, written to
    this job's folder (marked skipped) and logged, or None when the job has to run."""
    from src.tracking.mlflow_run import write_json

    if not OmegaConf.select(cfg, "sweep.resume", default=False):
        return None
    path = Path(sweep_dir) / FINISHED_FILE
    if not path.exists():
        return None
    h = config_hash(cfg)
    entry = json.loads(path.read_text()).get(h)
    if entry is None:
        return None
    summary = {**entry["summary"], "status": "finished", "mlflow_run_id": entry["run_id"], "config_hash": h,
               "skipped": f"finished before as MLflow run {entry['run_id']}"}
    write_json(Path(output_dir) / "summary.json", summary)
    log.info("job %s (%s): skipped, it finished before as MLflow run %s (config_hash %s); sweep.resume runs only the rest",
             job_num, entry["run_name"], entry["run_id"][:8], h)
    return summary


def tag_job_run(client_for_uri, uri: str, output_dir: Path, cfg: DictConfig) -> None:
    """Tag the job's MLflow run (its id left in its folder by the tracker) with its config_hash."""
    from src.tracking.mlflow_run import RUN_ID_FILE

    id_file = output_dir / RUN_ID_FILE
    if not id_file.exists():  # a skipped job made no run; an untracked one has none
        return
    client_for_uri(uri).set_tag(id_file.read_text().strip(), "config_hash", config_hash(cfg))


def supersede(client, experiment_id: str, parent_run_id: str) -> list[str]:
    """Keep one child per config (its hash, else its name: the values the sweep varies): the
    newest FINISHED, else the newest; tag the others superseded_by it and delete them. Returns a
    line per run deleted."""
    runs = children(client, experiment_id, parent_run_id)
    # A run whose process died before its job ended (the sweep killed) has no hash: it joins the
    # hashed config of its name, when one config alone has that name (tracking.run_name may give
    # every job the same one).
    hashes_of_name: dict[str, set[str]] = {}
    for run in runs:
        if run.data.tags.get("config_hash"):
            hashes_of_name.setdefault(run.info.run_name, set()).add(run.data.tags["config_hash"])
    groups: dict[str, list] = {}
    for run in runs:
        hashes = hashes_of_name.get(run.info.run_name, set())
        key = run.data.tags.get("config_hash") or (next(iter(hashes)) if len(hashes) == 1 else f"name:{run.info.run_name}")
        groups.setdefault(key, []).append(run)
    lines = []
    for runs in groups.values():
        if len(runs) < 2:
            continue
        runs.sort(key=lambda r: (r.info.status == "FINISHED", r.info.start_time or 0), reverse=True)
        keep, *rest = runs
        for run in rest:
            client.set_tag(run.info.run_id, "superseded_by", keep.info.run_id)
            if run.info.status == "RUNNING":  # its sweep process died with it: it is not running
                client.set_terminated(run.info.run_id, status="KILLED")
            client.delete_run(run.info.run_id)
            lines.append(f"run {run.info.run_id[:8]} ({run.info.run_name}, {run.info.status}) superseded by run {keep.info.run_id[:8]} "
                         f"({keep.info.status}): deleted from the sweep (`mlflow runs restore --run-id {run.info.run_id}` brings it back)")
    return lines
