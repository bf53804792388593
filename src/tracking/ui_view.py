"""The MLflow UI opened on the comparison: a view saved in the experiment, and the URL that loads it.

MLflow 3.17's UI (the bundle under mlflow/server/js/build) keeps an experiment page's state in two
places: the search facets (filter, sort, time range, state) in the URL's query, and the rest (the
columns, their order and widths, the charts) in the browser's localStorage, which a URL cannot set.
Its "Save view" / "Share" button stores both as one JSON under the experiment tag
`mlflow.sharedViewState.<key>` and gives `#/experiments/<id>/runs?viewStateShareKey=<key>`; any
browser that opens that URL reads the tag and shows the view. This module writes such a tag itself:

- the tag's value is an envelope `{"name", "createdAt", "updatedAt", "state"}` (ms since the epoch),
  `state` the view serialized as JSON, or `deflate;` + base64 of its zlib-deflated JSON (the UI
  inflates with pako, which reads zlib's format). The UI refuses to save an envelope over 20,000
  characters (MLflow's cap on an experiment tag's value), and keeps at most 40 views an experiment.
- the UI takes the search facets from the view only when the URL carries none of them, and drops
  runsExpanded, runsPinned, runsHidden, runsVisibilityMap and autoRefreshEnabled from a shared view.
  So a sweep's parent cannot be shown expanded; the view filters to its children instead.
- `workflowType=machine_learning` in the URL: MLflow 3.17 opens an experiment as its UI-wide
  "GenAI / Model training" switch says (localStorage, GenAI until a user flips it), on the GenAI
  overview, whatever the experiment's tags; the query sets the switch for that page. The experiment
  tag mlflow.experimentKind (src/tracking/mlflow_run.py sets it) is what UIs without the switch read.

Two views: one per experiment and task (every run of the task in the study, by its headline
figure; a run's end prints it), and one per sweep (its children only; the sweep's end prints it).
"""
from __future__ import annotations

import base64
import json
import logging
import time
import zlib
from collections.abc import Iterable
from typing import Any

log = logging.getLogger(__name__)

VIEW_TAG = "mlflow.sharedViewState."  # + the key: the tag the UI reads a shared view from
KEY_PREFIX = "perflab-"  # the views this project writes; others (a user's own saved views) are never touched
SWEEP_VIEWS_KEPT = 10  # a sweep's view is one tag: the 10 newest are kept, room for 30 of a user's own under the UI's 40
LOCAL_UI = "http://127.0.0.1:5000"  # where `mlflow ui` serves a SQLite store by default
MAX_ENVELOPE = 20000  # MLflow's MAX_EXPERIMENT_TAG_VAL_LENGTH, and the UI's own limit on a saved view
CURVES = ("loss", "tokens_per_s_per_device")  # step metrics charted as lines when a run logged them at more than one step
# The settings that tell two runs of a study apart, shown as columns in a task's view (the sweep's
# view shows the keys it varies instead): the preset and the groups a run is most often varied by.
SETTING_PARAMS = ("exp", "model.name", "sharding.name", "precision.name", "backend.name")


def metric_column(name: str) -> str:
    """A metric's column id, as the UI writes it (makeCanonicalSortKey): `metrics.` and the name in backticks."""
    return f"metrics.`{name}`"


def param_column(name: str) -> str:
    return f"params.`{name}`"


def _width(header: str) -> int:
    """Pixels that show a header whole (the UI cuts it at the end, where `_min` and `_max` differ):
    about 7 a character of its 13 px font and 45 for the sort and menu icons, 110 at least, 320 at most."""
    return max(110, min(320, round(7 * len(header)) + 45))


def _line_chart(uuid: str, section: str, metric: str) -> dict[str, Any]:
    """A line chart of one step metric (the UI's RunsChartsLineCardConfig, as its constructor fills it)."""
    return {
        "uuid": uuid, "type": "LINE", "metricSectionId": section, "deleted": False,
        "isGenerated": False,  # the UI re-types and re-sorts only charts it generated itself
        "displayName": metric, "metricKey": metric, "selectedMetricKeys": [metric],
        "runsCountToCompare": 10, "lineSmoothness": 0, "xAxisKey": "step", "xAxisScaleType": "linear",
        "scaleType": "linear", "selectedXAxisMetricKey": "", "yAxisKey": "metric", "yAxisExpressions": [],
        "range": {"xMin": None, "xMax": None, "yMin": None, "yMax": None},
        "ignoreOutliers": False, "useGlobalXaxisKey": True, "useGlobalLineSmoothing": True,
    }


def _bar_chart(uuid: str, section: str, metric: str) -> dict[str, Any]:
    """A bar per run of a metric logged once (RunsChartsBarCardConfig); the runs in the table's
    order (the headline's), the first 10 of them (runsCountToCompare, the UI's default)."""
    return {
        "uuid": uuid, "type": "BAR", "metricSectionId": section, "deleted": False, "isGenerated": False,
        "displayName": metric, "metricKey": metric, "selectedMetricKeys": [metric], "runsCountToCompare": 10,
    }


def view_state(figures: Iterable[str], params: Iterable[str], search_filter: str, lower_is_better: bool = False,
               curves: Iterable[str] = (), bars: Iterable[str] | None = None, section: str = "Compared") -> dict[str, Any]:
    """The state the UI's runs page takes from a shared view: `figures` (metric names, the headline
    first: the runs are sorted by it; by start time, newest first, when there is none) and `params`
    as columns, the runs `search_filter` (MLflow's search syntax) selects, and in the chart view
    (compareRunsMode=CHART) a first section, `section`, with the `curves` as lines and `bars`
    (the figures when None) as a bar per run."""
    figures, params, curves = list(dict.fromkeys(figures)), list(params), list(curves)
    columns = [metric_column(m) for m in figures] + [param_column(p) for p in params]
    uuid = "perflab-section"
    charts = [_line_chart(f"perflab-line-{m}", uuid, m) for m in curves]
    charts += [_bar_chart(f"perflab-bar-{m}", uuid, m) for m in (figures if bars is None else bars)]
    return {
        # the search facets: the same keys the URL's query carries when it carries any
        "searchFilter": search_filter,
        "orderByKey": metric_column(figures[0]) if figures else "attributes.start_time",
        # the best run first: a latency ascending, a throughput descending; the newest first by time
        "orderByAsc": lower_is_better if figures else False,
        "startTime": "ALL",  # every run, not the last hour or day
        "lifecycleFilter": "Active",  # deleted runs stay hidden
        "modelVersionFilter": "All Runs",
        "datasetsFilter": [],
        # the columns beside the run's name, its start and its duration (the three the UI always shows);
        # Source, Models and Dataset, the UI's default columns, say nothing here (a project logs none)
        "selectedColumns": columns,
        # the order the table shows them in: the UI sorts the selection by name otherwise. It holds
        # every shown column's id (the UI saves it so; ids it does not find are skipped)
        "columnOrder": ["attributes.`Run Name`", "runDateAndNestInfo", "duration", *columns],
        "columnWidths": {c: _width(c.split("`")[1]) for c in columns},
        # the charts show the first 10 runs of the table (the 10 best); the table lists them all
        "runsHiddenMode": "FIRST_10_RUNS",
        # the chart view: this section first (the UI puts named sections before its own "Model
        # metrics" and "System metrics", which it fills with every other metric the runs logged)
        "compareRunCharts": charts,
        "compareRunSections": [{"uuid": uuid, "name": section, "display": True,
                                "isReordered": False, "deleted": False, "isGenerated": False}],
        "isAccordionReordered": False,
        "hideEmptyCharts": True,  # a figure no run in the view logged draws no empty chart
        "useGroupedValuesInCharts": True,
        "viewMaximized": False,
        "runListHidden": False,
        "groupBy": None,
        "groupsExpanded": {},
        "globalLineChartConfig": {"xAxisKey": "step", "lineSmoothness": 0, "selectedXAxisMetricKey": ""},
    }


def envelope(name: str, state: dict[str, Any], now_ms: int | None = None) -> str:
    """The tag's value: plain JSON while it fits, the UI's `deflate;` form past MAX_ENVELOPE."""
    now_ms = int(time.time() * 1000) if now_ms is None else now_ms
    text = json.dumps(state, separators=(",", ":"))
    value = json.dumps({"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": text})
    if len(value) > MAX_ENVELOPE:
        packed = "deflate;" + base64.b64encode(zlib.compress(text.encode(), 9)).decode()
        value = json.dumps({"name": name, "createdAt": now_ms, "updatedAt": now_ms, "state": packed})
    return value


def read_state(value: str) -> dict[str, Any]:
    """The view a tag's value holds (envelope()'s inverse, as the UI reads it)."""
    state = json.loads(value)["state"]
    if state.startswith("deflate;"):
        state = zlib.decompress(base64.b64decode(state[len("deflate;"):])).decode()
    return json.loads(state)


def ui_base(uri: str) -> str:
    """The UI's address: the tracking server itself, or `mlflow ui`'s default for a SQLite store."""
    return uri.rstrip("/") if uri.startswith(("http://", "https://")) else LOCAL_UI


def view_url(uri: str, experiment_id: str, key: str, charts: bool = False) -> str:
    """The URL that opens `key`'s view on the runs page: `#/experiments/<id>/runs` (the UI routes
    by the hash), the view's key, the UI's switch set to model training, and the table or the charts."""
    query = f"workflowType=machine_learning&viewStateShareKey={key}"
    if charts:
        query += "&compareRunsMode=CHART"  # the UI's third button: TABLE (the default), CHART, ARTIFACT
    return f"{ui_base(uri)}/#/experiments/{experiment_id}/runs?{query}"


def save_view(client, experiment_id: str, key: str, name: str, state: dict[str, Any]) -> None:
    client.set_experiment_tag(experiment_id, VIEW_TAG + key, envelope(name, state))


def prune_sweep_views(client, experiment_id: str, keep: int = SWEEP_VIEWS_KEPT) -> None:
    """Delete this project's sweep views past the `keep` newest (by the envelope's updatedAt)."""
    tags = client.get_experiment(experiment_id).tags
    mine = []
    for tag, value in tags.items():
        if tag.startswith(VIEW_TAG + KEY_PREFIX + "sweep-"):
            try:
                mine.append((int(json.loads(value).get("updatedAt", 0)), tag))
            except (ValueError, AttributeError):
                mine.append((0, tag))
    for _, tag in sorted(mine, reverse=True)[keep:]:
        client.delete_experiment_tag(experiment_id, tag)


def _figures(task: str, metric: str | None = None) -> list[str]:
    """The figures compared, first the one sorted on: `metric`, else the task's headline."""
    from src.tracking.figures import figures_of, headline

    return list(dict.fromkeys([metric or headline(task), *figures_of(task).shown]))


def _key(base: str, task: str, metric: str | None) -> str:
    """A view's key: one per sort, so a view sorted on another figure (compare --metric) leaves the
    headline's, whose URL a run printed, as it was."""
    from src.tracking.figures import headline

    return f"{KEY_PREFIX}{base}" + (f"-by-{metric}" if metric and metric != headline(task) else "")


def _compared(client, run, figures: list[str]) -> dict[str, Any]:
    """view_state's metric arguments from what a run of the view logged: each figure's `summary.`
    metric, then its curve's extremes (`summary.loss_min` for final_loss), which chart no bar; the
    run's sort order; the CURVES it logged at more than one step."""
    from src.tracking.figures import lower_is_better

    logged = set(run.data.metrics)
    shown = [f"summary.{f}" for f in figures if f"summary.{f}" in logged]
    extremes = [f"summary.{base}_{end}" for base in ("loss" if f == "final_loss" else f for f in figures)
                for end in ("min", "max") if f"summary.{base}_{end}" in logged]
    curves = [c for c in CURVES if c in logged and len(client.get_metric_history(run.info.run_id, c)) > 1]
    lower = bool(shown) and lower_is_better(shown[0].removeprefix("summary."))
    return {"figures": shown + list(dict.fromkeys(extremes)), "bars": shown, "curves": curves, "lower_is_better": lower}


def _settings(client, run, task: str) -> list[str]:
    """The SETTING_PARAMS columns of a task's view: those `run` logged a value for, and those it
    logged as None (`exp` without +exp=...) only once another run of the task has a value, so a
    column of None alone is not shown."""
    params = run.data.params
    return [p for p in SETTING_PARAMS if p in params and (params[p] != "None" or client.search_runs(
        [run.info.experiment_id], f"params.`task.name` = '{task}' and params.`{p}` != 'None'", max_results=1))]


def task_view(client, uri: str, run_id: str, task: str, metric: str | None = None) -> str:
    """Save the view of every `task` run in `run_id`'s experiment, by `metric` (the task's headline
    when None), the columns those `run_id` logged; its URL."""
    run = client.get_run(run_id)
    exp_id = run.info.experiment_id
    figures = _figures(task, metric)
    params = _settings(client, run, task)
    state = view_state(params=params, search_filter=f"params.`task.name` = '{task}'", section=f"{task}: {figures[0]}",
                       **_compared(client, run, figures))
    key = _key(task, task, metric)
    save_view(client, exp_id, key, state=state, name=f"perflab: {task} runs by {figures[0]}")
    return view_url(uri, exp_id, key)


# Tableau's 10 colours: a sweep's jobs in tell-apart colours (MLflow's own, from the run's id, gave
# two jobs of a sweep two shades of orange), the first job blue
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
RUN_COLOR_TAG = "mlflow.runColor"  # the run tag the UI's colour picker sets, and reads before its own choice


def sweep_view(client, uri: str, parent_run_id: str, task: str, metric: str | None = None) -> str | None:
    """Save the view of a sweep's children by `metric` (the task's headline when None), its varied
    keys as columns (the parent's params: src/tracking/sweep.py names them as the children's), and
    colour its first 10 jobs apart; its URL. None when the sweep has no child in the store."""
    parent = client.get_run(parent_run_id)
    exp_id = parent.info.experiment_id
    children = client.search_runs([exp_id], f"tags.mlflow.parentRunId = '{parent_run_id}'", max_results=50,
                                  order_by=["attributes.start_time ASC"])
    if not children:
        return None
    for child, colour in zip(children, PALETTE):
        if RUN_COLOR_TAG not in child.data.tags:  # a colour picked in the UI stays
            client.set_tag(child.info.run_id, RUN_COLOR_TAG, colour)
    figures = _figures(task, metric)
    finished = [c for c in children if c.info.status == "FINISHED"] or children
    sample = max(finished, key=lambda c: len(c.data.metrics))  # the child that logged the most figures
    state = view_state(params=list(parent.data.params), search_filter=f"tags.`mlflow.parentRunId` = '{parent_run_id}'",
                       section=f"sweep: {figures[0]}", **_compared(client, sample, figures))
    key = _key(f"sweep-{parent_run_id[:12]}", task, metric)
    save_view(client, exp_id, key, name=(parent.info.run_name or "sweep")[:200], state=state)
    prune_sweep_views(client, exp_id)
    return view_url(uri, exp_id, key)


def open_hint(uri: str, url: str) -> str:
    """The line that says how to open `url`: at once on a server, after `mlflow ui` on a SQLite store."""
    if uri.startswith(("http://", "https://")):
        return f"open {url}"
    return f"run `mlflow ui --backend-store-uri {uri}`, then open {url}"


def _hint(uri: str, shown_uri: str | None, make, client=None) -> str:
    """`make(client)`'s URL as the line to print, or the plain hint when the store does not take the
    view (a server gone at the run's end, an old server): the run is done either way."""
    from src.tracking.mlflow_run import TrackingUnavailable, check_reachable, client_for, ui_hint

    shown_uri = shown_uri or uri
    try:
        check_reachable(uri, 3.0)
        url = make(client or client_for(uri))
    except TrackingUnavailable:
        return ui_hint(shown_uri)
    except Exception as err:  # the view is a convenience: a store that refuses it costs the link, not the run
        log.debug("no MLflow view saved: %s", err)
        return ui_hint(shown_uri)
    return open_hint(shown_uri, url) if url else ui_hint(shown_uri)


def run_hint(uri: str, run_id: str, task: str, shown_uri: str | None = None, client=None) -> str:
    """How to see a run among its task's runs (task_view), as the run's last line says it;
    `shown_uri`: the store as the user wrote it (a relative sqlite path), `uri` as resolved."""
    return _hint(uri, shown_uri, lambda c: task_view(c, uri, run_id, task), client)


def sweep_hint(client, parent_run_id: str, task: str, metric: str | None = None, shown_uri: str | None = None) -> str:
    """How to see a sweep's children side by side (sweep_view), through the sweep's own client."""
    uri = str(client.tracking_uri)
    return _hint(uri, shown_uri, lambda c: sweep_view(c, uri, parent_run_id, task, metric), client)
