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
import sys
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.table import Table

# each task package declares its figures when imported (src/tracking/figures.py)
import src.diagnose  # noqa: F401
import src.edge  # noqa: F401
import src.train  # noqa: F401
from src.runtime import world_label
from src.tracking.figures import best_row, figures_of, headline, is_number, lower_is_better

PARAMS = ("model", "sharding", "precision", "backend", "kernels", "data", "world_size")
# Short headers: five figures and a run name fit 100 columns (tokens_per_s_per_device alone is 23).
SHORT = {"tokens_per_s_per_device": "tok/s/dev", "peak_mem_gb": "peak GB", "final_loss": "loss", "step_time_s": "step s",
         "mfu": "MFU %", "decode_tokens_per_s": "dec tok/s", "prefill_tokens_per_s": "pre tok/s", "decode_p50_ms": "dec p50 ms",
         "ttft_p50_ms": "TTFT p50", "rel_err": "rel err", "share_memory_bound": "mem-bound"}


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
        p = r.data.params
        row = {"run": r.info.run_name, "status": r.info.status.lower(), "id": r.info.run_id[:8], "task": p.get("task.name")}
        row.update({
            "model": p.get("model.name"), "sharding": p.get("sharding.name"), "precision": p.get("precision.name"),
            "backend": p.get("backend.name"), "kernels": p.get("kernels.name"), "data": p.get("data.name"),
            "world_size": world_label(r.data.tags.get("world_size"), p.get("dist.fake") == "True"),
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
            row = {"run": str(summary_path.parent.relative_to(root)) or root.name, "status": s.get("status", "?"), "id": "", "task": s.get("task")}
            row.update({k: s.get("settings", {}).get(k) for k in PARAMS})
            row["world_size"] = world_label(row["world_size"], s.get("settings", {}).get("dist_fake", False))
            row.update({k: v for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            rows.append(row)
    return rows


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each run's name without the words every run shares, keys cut to their last part
    (`edge.dtype=fp16` -> `dtype=fp16`): short, and fp16 never cut down to look like fp32."""
    words = [str(r["run"]).split() for r in rows]
    common = set.intersection(*(set(w) for w in words)) if len(rows) > 1 else set()
    def short(word: str) -> str:
        key, eq, value = word.partition("=")
        return key.lstrip("+").rsplit(".", 1)[-1] + eq + value
    return [" ".join(short(w) for w in ws if w not in common) or " ".join(ws) for ws in words]


def _cell(v: Any) -> str:
    if not is_number(v):
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def render(rows: list[dict[str, Any]], metric: str | None, console: Console) -> None:
    tasks = [r.get("task") for r in rows if r.get("task")]
    task = max(set(tasks), key=tasks.count) if tasks else "train"
    metric = metric or headline(task)
    lower = lower_is_better(metric)
    rows = sorted(rows, key=lambda r: (not is_number(r.get(metric)), 0.0 if not is_number(r.get(metric)) else (r[metric] if lower else -r[metric])))
    best = best_row(rows, metric)
    figures = [metric] + [m for m in figures_of(task).shown if m != metric and any(is_number(r.get(m)) for r in rows)]
    labels = _labels(rows)
    varying = [p for p in PARAMS if len({str(r.get(p)) for r in rows}) > 1 and not all(f"{p}=" in lab for lab in labels)]
    same = [f"{p}={rows[0][p]}" for p in PARAMS if len({str(r.get(p)) for r in rows}) == 1 and rows[0].get(p) is not None]
    with_status = any(r["status"] != "finished" for r in rows)
    table = Table(title=f"{len(rows)} runs by {metric} ({'lower' if lower else 'higher'} is better)",
                  caption=("all: " + " ".join(same)) if same else None, caption_justify="left")
    table.add_column("", width=1)
    table.add_column("run", overflow="fold", min_width=min(max(map(len, labels)), 30))
    if with_status:
        table.add_column("status")
    for p in varying:
        table.add_column(p)
    for m in figures:
        table.add_column(SHORT.get(m, m), justify="right")
    for r, label in zip(rows, labels):
        cells = ["★" if r is best else "", label, *([r["status"]] if with_status else []), *(str(r.get(p)) for p in varying)]
        table.add_row(*cells, *(_cell(r.get(m)) for m in figures), style="bold green" if r is best else ("red" if r["status"] != "finished" else None))
    console.print(table)


def _no_store(uri: str) -> str | None:
    """Reading an sqlite URI creates the file: with no store yet, say so instead of leaving an empty mlflow.db."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not Path(uri[len(prefix):]).exists():
        return (f"no MLflow store at {uri[len(prefix):]}: run `python -m src.run` here first, or pass --uri "
                "(e.g. --uri http://127.0.0.1:5000 or --uri sqlite:////path/to/mlflow.db), or --dirs outputs multirun")
    return None


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m src.compare", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--uri", default="sqlite:///mlflow.db", help="MLflow tracking URI (default: sqlite:///mlflow.db here)")
    ap.add_argument("--experiment", help="MLflow experiment (default: all)")
    ap.add_argument("--sweep", help="a sweep's parent run id, or 'latest'")
    ap.add_argument("--metric", default=None, help="sort by this figure, the best run marked (default: the task's headline, e.g. tokens_per_s_per_device)")
    ap.add_argument("--dirs", nargs="*", type=Path, help="read summary.json files under these directories instead of MLflow")
    ap.add_argument("--width", type=int, default=None, help="terminal width for the table")
    args = ap.parse_args(argv)
    console = Console(width=args.width)
    try:
        if args.dirs:
            rows = rows_from_dirs(args.dirs)
        else:
            from src.tracking.mlflow_run import TrackingUnavailable, check_reachable

            missing = _no_store(args.uri)
            if missing:
                sys.stderr.write(f"error: {missing}\n")
                return 2
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
        where = f"under {' '.join(map(str, args.dirs))}" if args.dirs else f"at {args.uri}"
        sys.stderr.write(f"error: no runs found {where}; pass --uri URI for another MLflow store, or --dirs DIR for run directories\n")
        return 2
    render(rows, args.metric, console)
    return 0


if __name__ == "__main__":
    sys.exit(main())
