"""`python -m src.compare`: runs side by side in the terminal, best marked.

    python -m src.compare --experiment perflab --metric tokens_per_s_per_device
    python -m src.compare --sweep latest              # the newest sweep's parent run and its children
    python -m src.compare --sweep latest --ui         # ... and the MLflow UI's URL of them, opened
    python -m src.compare --dirs multirun/2026-11-30/10-00-00   # from run directories, no tracking store needed

Reads MLflow (the runs' params and their `summary.*` metrics); with --dirs, or when the store
cannot be reached, reads the summary.json files that every run leaves in its directory. --ui
prints the URL of the same runs in MLflow's UI, sorted as here with the figures as columns
(src/tracking/ui_view.py), and opens it in a browser where there is a display and the UI answers.
"""
from __future__ import annotations

import argparse
import io
import json
import os
import sys
from pathlib import Path
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table

# each task package declares its figures when imported (src/tracking/figures.py)
import src.diagnose  # noqa: F401
import src.edge  # noqa: F401
import src.train  # noqa: F401
from src.runtime import world_label
from src.tracking.figures import best_row, figures_of, headline, is_number, left_out, lower_is_better
from src.tracking.mlflow_run import resolve_tracking_uri

PARAMS = ("model", "sharding", "precision", "backend", "kernels", "data", "world_size")
# Short headers, so that several figures fit whole beside the run's name at 80 columns
# (tokens_per_s_per_device alone is 23).
SHORT = {"tokens_per_s_per_device": "tok/s/dev", "peak_mem_gb": "peak GB", "final_loss": "loss", "step_time_s": "step s",
         "mfu": "MFU %", "decode_tokens_per_s": "dec tok/s", "prefill_tokens_per_s": "pre tok/s", "decode_p50_ms": "dec p50 ms",
         "ttft_p50_ms": "TTFT p50", "rel_err": "rel err", "share_memory_bound": "mem-bound", "token_agreement": "same tok",
         "params_bytes": "params B", "module_bytes": "module B", "perplexity_increase": "ppl rise"}


def _experiments(client, uri: str, experiment: str | None) -> list[str]:
    if experiment:
        exp = client.get_experiment_by_name(experiment)
        if exp is None:
            raise LookupError(f"no MLflow experiment named '{experiment}' at {uri}")
        return [exp.experiment_id]
    return [e.experiment_id for e in client.search_experiments()]


def _latest_sweep(client, experiments: list[str]):
    parents = client.search_runs(experiments, "tags.sweep = 'true'", order_by=["attributes.start_time DESC"], max_results=1)
    if not parents:
        raise LookupError("no sweep parent run found")
    return parents[0]


def _sweep_parent(client, uri: str, run_id: str):
    from mlflow.exceptions import MlflowException

    try:
        run = client.get_run(run_id)
    except MlflowException:
        raise LookupError(f"--sweep {run_id}: no such run at {uri}; give a sweep's parent run id, or --sweep latest") from None
    if run.data.tags.get("sweep") != "true":
        raise LookupError(f"--sweep {run_id}: run {run.info.run_name!r} is not a sweep's parent run; give its parent's id, or --sweep latest")
    return run


def sweep_objective(parent) -> str | None:
    """The figure a sweep was judged by, from its parent run's `objective` tag ("final_loss (lower is
    better)", src/tracking/sweep.py): the figure its best_job and Optuna's best were chosen on."""
    tag = parent.data.tags.get("objective", "")
    return tag.split(" ", 1)[0] or None


def rows_from_mlflow(uri: str, experiment: str | None, sweep: str | None) -> tuple[list[dict[str, Any]], str | None]:
    """The rows to compare and the figure to rank them by where the runs name one (a sweep's
    objective). A sweep: its jobs; otherwise the runs of the newest run's task."""
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=resolve_tracking_uri(uri, Path.cwd()))  # MLflow caches a store by its URI's text
    experiments = _experiments(client, uri, experiment)
    objective = None
    if sweep:
        parent = _latest_sweep(client, experiments) if sweep == "latest" else _sweep_parent(client, uri, sweep)
        objective = sweep_objective(parent)
        runs = client.search_runs([parent.info.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'", max_results=1000)
    else:
        runs = client.search_runs(experiments, "", order_by=["attributes.start_time DESC"], max_results=1000)
        newest = next((r for r in runs if r.data.tags.get("sweep") != "true" and r.data.params.get("task.name")), None)
        task = newest.data.params.get("task.name") if newest else None
        runs = [r for r in runs if r.data.params.get("task.name") == task]
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
    return rows, objective


def rows_from_dirs(roots: list[Path]) -> list[dict[str, Any]]:
    rows = []
    for root in roots:
        for summary_path in sorted(root.rglob("summary.json")):
            if "diagnose" in summary_path.parts[len(root.parts):-1] or "target" in summary_path.parent.name:
                continue
            try:
                s = json.loads(summary_path.read_text())
            except (json.JSONDecodeError, UnicodeDecodeError) as err:  # a run killed while writing it: the others still compare
                sys.stderr.write(f"warning: {summary_path}: cut off or not JSON ({err.msg if hasattr(err, 'msg') else err}); left out\n")
                continue
            row = {"run": str(summary_path.parent.relative_to(root)) or root.name, "status": s.get("status", "?"), "id": "", "task": s.get("task")}
            row.update({k: s.get("settings", {}).get(k) for k in PARAMS})
            row["world_size"] = world_label(row["world_size"], s.get("settings", {}).get("dist_fake", False))
            row.update({k: v for k, v in s.items() if isinstance(v, (int, float)) and not isinstance(v, bool)})
            rows.append(row)
    return rows


def _labels(rows: list[dict[str, Any]]) -> list[str]:
    """Each run's name without the words every run shares, keys whole (`train.steps=30`, never a
    bare `steps=30` that could be any group's)."""
    words = [str(r["run"]).split() for r in rows]
    common = set.intersection(*(set(w) for w in words)) if len(rows) > 1 else set()
    return [" ".join(w.lstrip("+") for w in ws if w not in common) or " ".join(ws) for ws in words]


def _cell(v: Any) -> str:
    if not is_number(v):
        return "n/a"
    return f"{v:,.0f}" if abs(v) >= 100 else f"{v:.4g}"


def _table(rows: list[dict[str, Any]], labels: list[str], figures: list[str], best, with_status: bool, caption: str | None) -> Table:
    table = Table(caption=caption, caption_justify="left", box=box.SIMPLE_HEAD, pad_edge=False)
    table.add_column("", width=1, no_wrap=True)
    for m in figures:
        cells = [_cell(r.get(m)) for r in rows]
        header = SHORT.get(m, m)
        table.add_column(header, justify="right", no_wrap=True, min_width=max(len(header), *map(len, cells)))
    if with_status:
        table.add_column("status", no_wrap=True, min_width=max(len(r["status"]) for r in rows))
    table.add_column("run", overflow="fold", min_width=12)
    for r, label in zip(rows, labels):
        table.add_row("★" if r is best else "", *(_cell(r.get(m)) for m in figures), *([r["status"]] if with_status else []), label,
                      style="bold green" if r is best else ("red" if r["status"] != "finished" else None))
    return table


def _fits(table: Table, width: int) -> bool:
    """The table at `width` columns with every cell whole: nothing cut to an ellipsis."""
    out = io.StringIO()
    Console(width=width, file=out, color_system=None).print(table)
    text = out.getvalue()
    return "…" not in text and max(map(len, text.splitlines()), default=0) <= width


def render(rows: list[dict[str, Any]], metric: str | None, console: Console, ranked_by: str = "") -> None:
    """The runs ranked by `metric` (the task's headline when None), best starred: the figures
    first, as many as fit the console's width whole, then the run's name, folded; what every run
    shares in the caption. `ranked_by`: why this metric (a sweep's objective)."""
    tasks = [r.get("task") for r in rows if r.get("task")]
    task = max(set(tasks), key=tasks.count) if tasks else "train"
    metric = metric or headline(task)
    lower = lower_is_better(metric)
    rows = sorted(rows, key=lambda r: (not is_number(r.get(metric)), 0.0 if not is_number(r.get(metric)) else (r[metric] if lower else -r[metric])))
    best = best_row(rows, metric)
    figures = [metric] + [m for m in figures_of(task).shown if m != metric and any(is_number(r.get(m)) for r in rows)]
    labels = _labels(rows)
    # a setting that varies but is not in the run names (runs started one by one) joins the names
    for p in PARAMS:
        if len({str(r.get(p)) for r in rows}) > 1 and not all(f"{p}=" in lab or str(r.get(p)) in lab.split() for lab, r in zip(labels, rows)):
            labels = [f"{lab} {p}={r.get(p)}".strip() for lab, r in zip(labels, rows)]
    same = [f"{p}={rows[0][p]}" for p in PARAMS if len({str(r.get(p)) for r in rows}) == 1 and rows[0].get(p) is not None]
    with_status = any(r["status"] != "finished" for r in rows)
    title = f"{len(rows)} {task} runs by {metric} ({'lower' if lower else 'higher'} is better{ranked_by})"
    out = left_out(rows)  # finished runs a quality bound keeps from the star, each named with why
    caption = "\n".join(filter(None, [("all: " + " ".join(same)) if same else None,
                                       *(f"not ranked: {lab}: {out[id(r)]}" for lab, r in zip(labels, rows) if id(r) in out)])) or None
    shown = list(figures)
    while len(shown) > 1 and not _fits(_table(rows, labels, shown, best, with_status, caption), console.width):
        shown.pop()
    left = [SHORT.get(m, m) for m in figures if m not in shown]
    if left:
        caption = "\n".join(filter(None, [caption, f"wider than {console.width} columns: {', '.join(left)} (--width, or --metric NAME)"]))
    console.print(title)
    console.print(_table(rows, labels, shown, best, with_status, caption))


def ui_url(uri: str, experiment: str | None, sweep: str | None, metric: str | None) -> str:
    """The MLflow UI's URL of the runs compared: a sweep's children (--sweep), else the runs of the
    newest run's task in its experiment (--experiment, else any), sorted by `metric` (the task's
    headline when None); the view it opens is saved in the experiment (src/tracking/ui_view.py)."""
    from mlflow import MlflowClient

    from src.tracking.ui_view import sweep_view, task_view

    client = MlflowClient(tracking_uri=resolve_tracking_uri(uri, Path.cwd()))  # MLflow caches a store by its URI's text
    experiments = _experiments(client, uri, experiment)
    if sweep:
        parent = _latest_sweep(client, experiments).info.run_id if sweep == "latest" else sweep
        metric = metric or sweep_objective(client.get_run(parent))
        exp_id = client.get_run(parent).info.experiment_id
        children = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent}'", max_results=1)
        task = children[0].data.params.get("task.name", "train") if children else "train"
        url = sweep_view(client, uri, parent, task, metric)
        if url is None:
            raise LookupError(f"sweep {parent[:8]} has no job in MLflow at {uri}")
        return url
    runs = client.search_runs(experiments, "params.`task.name` != ''", order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise LookupError(f"no run found at {uri}")
    return task_view(client, uri, runs[0].info.run_id, runs[0].data.params["task.name"], metric)


def _has_display() -> bool:
    """A browser can be shown: macOS, Windows, or an X11 or Wayland session (over SSH without
    forwarding, Python's webbrowser would start a text browser in the terminal instead)."""
    return sys.platform in ("darwin", "win32") or bool(os.environ.get("DISPLAY") or os.environ.get("WAYLAND_DISPLAY"))


def show_ui(uri: str, url: str, console: Console) -> None:
    """Print the URL (and how to start the UI for a SQLite store); open it where it can be seen."""
    import webbrowser

    from src.tracking.mlflow_run import TrackingUnavailable, check_reachable
    from src.tracking.ui_view import open_hint, ui_base

    console.print(f"MLflow: {open_hint(uri, url)}", soft_wrap=True)
    if not _has_display():
        return
    try:
        check_reachable(ui_base(uri), 2.0)  # a SQLite store's `mlflow ui` may not be running
    except TrackingUnavailable:
        return
    webbrowser.open(url)


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
    ap.add_argument("--ui", action="store_true", help="also print the MLflow UI's URL of these runs as a table sorted the same way, "
                    "and open it in a browser where there is a display")
    args = ap.parse_args(argv)
    console = Console(width=args.width)
    from_mlflow, objective = False, None
    if args.ui and args.dirs:
        sys.stderr.write("error: --ui shows runs in MLflow; --dirs reads run directories instead\n")
        return 2
    try:
        if args.dirs:
            rows = rows_from_dirs(args.dirs)
        else:
            from src.tracking.mlflow_run import TrackingUnavailable, check_reachable, shown_uri, store_refusal

            missing = _no_store(args.uri)
            refusal = None if missing else store_refusal(args.uri)
            if refusal:
                sys.stderr.write(f"error: --uri {shown_uri(args.uri)}: {refusal}\n")
                return 2
            if missing:
                sys.stderr.write(f"error: {missing}\n")
                return 2
            try:
                check_reachable(args.uri, 5.0)
                rows, objective = rows_from_mlflow(args.uri, args.experiment, args.sweep)
                from_mlflow = True
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
    if args.metric and not any(is_number(r.get(args.metric)) for r in rows):
        known = sorted({k for r in rows for k, v in r.items() if is_number(v) and k not in ("world_size",)})
        sys.stderr.write(f"error: --metric {args.metric}: no run here has it; they have: {', '.join(known)}\n")
        return 2
    render(rows, args.metric or objective, console, ", sweep objective" if objective and not args.metric else "")
    if args.ui and from_mlflow:
        try:
            show_ui(args.uri, ui_url(args.uri, args.experiment, args.sweep, args.metric), console)
        except LookupError as err:
            sys.stderr.write(f"error: {err}\n")
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
