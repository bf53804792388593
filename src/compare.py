"""`python -m src.compare`: runs side by side in the terminal, best marked.

    python -m src.compare --experiment fsdp4 --metric tokens_per_s_per_device
    python -m src.compare --sweep latest              # the newest sweep's parent run and its children
    python -m src.compare --dirs multirun/2026-11-30/10-00-00   # from run directories, no tracking store needed

Reads MLflow (the runs' params and their `summary.*` metrics); with --dirs, or when the store
cannot be reached, reads the summary.json files that every run leaves in its directory.
"""
from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

PARAMS = ("model", "sharding", "precision", "backend", "kernels", "data", "world_size")
METRICS = ("tokens_per_s_per_device", "mfu", "peak_mem_gb", "final_loss", "step_time_s")
LOWER_IS_BETTER = {"peak_mem_gb", "final_loss", "step_time_s", "share_memory_bound", "peak_mem_reserved_gb", "overhead_frac"}


def rows_from_mlflow(uri: str, experiment: str | None, sweep: str | None) -> list[dict[str, Any]]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise LookupError(f"no MLflow experiment named '{experiment}' at {uri}")
        experiments = [exp.experiment_id]
    else:
        experiments = [e.experiment_id for e in client.search_experiments()]
    if sweep == "latest":
        parents = client.search_runs(experiments, "tags.sweep = 'true'", order_by=["attributes.start_time DESC"], max_results=1)
        if not parents:
            raise LookupError("no sweep parent run found")
        sweep = parents[0].info.run_id
    filter_string = f"tags.mlflow.parentRunId = '{sweep}'" if sweep else ""
    runs = client.search_runs(experiments, filter_string, max_results=1000)
    rows = []
    for r in runs:
        if r.data.tags.get("sweep") == "true":
            continue
        row = {"run": r.info.run_name, "status": r.info.status.lower(), "id": r.info.run_id[:8]}
        p = r.data.params
        row.update({
            "model": p.get("model.name"), "sharding": p.get("sharding.name"), "precision": p.get("precision.name"),
            "backend": p.get("backend.name"), "kernels": p.get("kernels.name"), "data": p.get("data.name"),
            "world_size": r.data.tags.get("world_size"),
        })
        row.update({k[len("summary."):]: v for k, v in r.data.metrics.items() if k.startswith("summary.")})
        rows.append(row)
    return rows


def rows_from_dirs(roots: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for root in roots:
        for summary_path in sorted(root.rglob("summary.json")):
            if "diagnose" in summary_path.parts[len(root.parts):-1] or "target" in summary_path.parent.name:
                continue
            s = json.loads(summary_path.read_text())
            row = {"run": str(summary_path.parent.relative_to(root)) or root.name, "status": s.get("status", "?"), "id": ""}
            row.update({k: s.get("settings", {}).get(k) for k in PARAMS})
            row.update({k: v for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            rows.append(row)
    return rows


def render(rows: list[dict[str, Any]], metric: str, console: Console) -> None:
    lower = metric in LOWER_IS_BETTER

    def key(row):  # runs without the figure last; then best first
        v = row.get(metric)
        missing = not isinstance(v, (int, float)) or math.isnan(v)
        return (missing, 0.0 if missing else (v if lower else -v))

    rows = sorted(rows, key=key)
    best = next((r for r in rows if r["status"] == "finished" and isinstance(r.get(metric), (int, float))), None)
    metrics = [metric] + [m for m in METRICS if m != metric]
    table = Table(title=f"{len(rows)} runs by {metric} ({'lower' if lower else 'higher'} is better)")
    for col in ("", "run", "status", *PARAMS, *metrics):
        table.add_column(col, justify="right" if col in metrics else "left", overflow="fold")
    for r in rows:
        cells = ["★" if r is best else "", str(r["run"])[:48], r["status"]]
        cells += ["" if r.get(p) is None else str(r.get(p)) for p in PARAMS]
        for m in metrics:
            v = r.get(m)
            cells.append("n/a" if v is None else (f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"))
        table.add_row(*cells, style="bold green" if r is best else ("red" if r["status"] != "finished" else None))
    console.print(table)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m src.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", default="sqlite:///mlflow.db", help="MLflow tracking URI (default: sqlite:///mlflow.db here)")
    ap.add_argument("--experiment", help="MLflow experiment (default: all)")
    ap.add_argument("--sweep", help="a sweep's parent run id, or 'latest'")
    ap.add_argument("--metric", default="tokens_per_s_per_device", help="sort by this figure; the best run is marked")
    ap.add_argument("--dirs", nargs="*", type=Path, help="read summary.json files under these directories instead of MLflow")
    ap.add_argument("--width", type=int, default=None, help="terminal width for the table")
    args = ap.parse_args(argv)
    console = Console(width=args.width)
    try:
        if args.dirs:
            rows = rows_from_dirs(args.dirs)
        else:
            from src.tracking.mlflow_run import TrackingUnavailable, check_reachable

            try:
                check_reachable(args.uri, 5.0)
                rows = rows_from_mlflow(args.uri, args.experiment, args.sweep)
            except TrackingUnavailable as err:
                console.print(f"{err}; reading run directories (outputs/, multirun/) instead")
                rows = rows_from_dirs([p for p in (Path("outputs"), Path("multirun")) if p.exists()])
    except LookupError as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    if not rows:
        sys.stderr.write("error: no runs found\n")
        return 2
    render(rows, args.metric, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
