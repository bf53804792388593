"""MLflow's UI opened on the comparison (src/tracking/ui_view.py): a real 2-job sweep against a real
`mlflow server`, the URL its last line prints loaded in headless Chromium, and its DOM read: the
figure columns, both jobs (not the parent) best first, and in the chart view both jobs' loss
curves. Skipped where Chromium is not installed (`apt-get install chromium`; .ci/run installs it).
About 70 s on 2 cores: the server's start, the sweep (2 jobs of 4 steps on one rank each), and two
page loads of about 6 s each."""
from __future__ import annotations

import re
import shutil
import signal
import subprocess
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from tests.support.cli import run_cli
from tests.support.servers import start_mlflow_server, stop_server

CHROMIUM = next((p for p in map(shutil.which, ("chromium", "chromium-browser", "google-chrome")) if p), None)
needs_chromium = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (apt-get install chromium)")
FIGURES = ("tokens_per_s_per_device", "peak_mem_gb", "final_loss", "step_time_s",
           "tokens_per_s_per_device_min", "tokens_per_s_per_device_max", "loss_min", "loss_max")


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, mlflow_store_template):
    """The server's URL, the sweep's console output, and a folder for browser profiles."""
    tmp = tmp_path_factory.mktemp("ui")
    (tmp / "artifacts").mkdir()
    proc, url = start_mlflow_server(f"sqlite:///{tmp / 'server.db'}", tmp / "artifacts", seed=mlflow_store_template)
    try:
        work = tmp / "work"
        work.mkdir()
        args = ["-m", "precision=fp32,bf16", "dist.nproc=1", "sharding=none", "train.steps=4",
                "tracking.system_metrics=false", f"tracking.uri={url}"]
        out = run_cli(args, cwd=work, timeout=300)
        assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
        yield url, out.stdout + out.stderr, tmp
    finally:
        stop_server(proc, signal.SIGKILL)  # its store is thrown away: no 15 s of graceful shutdown


def _dom(url: str, profile: Path) -> str:
    """The page's DOM once it settled: 40 s of the page's own (virtual) time, about 6 s of ours. A
    window 3400 px wide: the table draws only the columns in view (9 here, 1,900 px of them)."""
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", f"--user-data-dir={profile}",
           "--window-size=3400,1000", "--virtual-time-budget=40000", "--dump-dom", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def _text(html: str) -> str:
    html = re.sub(r"<(script|style)\b.*?</\1>", " ", html, flags=re.S)
    return re.sub(r"\s+", " ", re.sub(r"<[^>]+>", " ", html))


@needs_chromium
def test_the_sweep_url_shows_its_jobs_side_by_side_with_their_figures(sweep):
    from mlflow import MlflowClient

    server, out, tmp = sweep
    found = re.search(r"its jobs are its children; open (http://\S+viewStateShareKey=perflab-sweep-\w+)", out)
    assert found, out[-2000:]
    url = found.group(1)
    assert url.startswith(f"{server}/#/experiments/") and "workflowType=machine_learning" in url
    assert "View experiment at" not in out  # MLflow's own link, which opens the GenAI overview, is not printed

    client = MlflowClient(server)
    exp = client.get_experiment_by_name("perflab")
    assert exp.tags["mlflow.experimentKind"] == "custom_model_development"
    (parent,) = client.search_runs([exp.experiment_id], "tags.sweep = 'true'")
    children = client.search_runs([exp.experiment_id], f"tags.mlflow.parentRunId = '{parent.info.run_id}'")
    best = max(children, key=lambda c: c.data.metrics["summary.tokens_per_s_per_device"])
    assert {c.data.tags["mlflow.runColor"] for c in children} == {"#1f77b4", "#ff7f0e"}  # told apart

    dom = _dom(url, tmp / "profile-table")
    for figure in FIGURES:
        assert f'col-id="metrics.`summary.{figure}`"' in dom, figure
    assert 'col-id="params.`precision.name`"' in dom  # what the sweep varies
    assert 'col-id="attributes.`Source`"' not in dom  # the UI's default columns, empty here, are gone
    rows = dict(re.findall(r'row-index="(\d+)" row-id="(\w+)"', dom))
    assert set(rows.values()) == {c.info.run_id for c in children}  # the jobs, and not their parent
    assert rows["0"] == best.info.run_id  # best first by the headline
    text = _text(dom)
    assert {c.info.run_name for c in children} == {"fp32", "bf16"} and all(name in text for name in ("fp32", "bf16"))
    assert "Sort: summary.tokens_per_s_per_device" in text

    charts = _text(_dom(url + "&compareRunsMode=CHART", tmp / "profile-charts"))
    assert "sweep: tokens_per_s_per_device" in charts  # the view's own section, first
    assert "fp32 (loss)" in charts and "bf16 (loss)" in charts  # both loss curves' legends


def test_a_view_round_trips_through_its_tag_plain_and_deflated():
    """The UI reads a view as plain JSON, or as `deflate;` + base64 of zlib's output past MLflow's
    20,000-character cap on an experiment tag's value."""
    from src.tracking.ui_view import MAX_ENVELOPE, envelope, read_state, view_state

    state = view_state(["summary.tokens_per_s_per_device"], ["precision.name"], "params.`task.name` = 'train'")
    assert read_state(envelope("v", state)) == state and '"state": "{' in envelope("v", state)
    assert state["orderByKey"] == "metrics.`summary.tokens_per_s_per_device`" and state["orderByAsc"] is False
    big = {**state, "searchFilter": "x" * 3 * MAX_ENVELOPE}
    packed = envelope("v", big)
    assert len(packed) < MAX_ENVELOPE and '"state": "deflate;' in packed and read_state(packed) == big


def test_a_task_view_shows_a_setting_all_its_runs_left_none_only_once_one_has_it(tmp_path):
    """Seen in the UI: a column `exp` reading None for every run made without +exp=. It shows once
    a run of the task has an exp, and then for every run of the task."""
    from mlflow import MlflowClient

    from src.tracking.ui_view import VIEW_TAG, read_state, task_view

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    experiment = client.create_experiment("perflab")

    def run(exp: str, task: str = "train") -> str:
        run_id = client.create_run(experiment).info.run_id
        for key, value in {"task.name": task, "exp": exp, "model.name": "tiny", "precision.name": "bf16"}.items():
            client.log_param(run_id, key, value)
        client.log_metric(run_id, "summary.tokens_per_s_per_device", 1.0)
        return run_id

    def columns() -> list[str]:
        return read_state(client.get_experiment(experiment).tags[VIEW_TAG + "perflab-train"])["selectedColumns"]

    plain = run("None")
    run("profile", task="profile")  # another task's exp says nothing of train's runs
    task_view(client, "sqlite:///mlflow.db", plain, "train")
    assert "params.`exp`" not in columns() and "params.`model.name`" in columns()
    run("fsdp4")
    task_view(client, "sqlite:///mlflow.db", plain, "train")
    assert "params.`exp`" in columns()


def test_one_experiment_per_task_and_presets_do_not_split():
    from src.tracking.mlflow_run import experiment_name

    def cfg(task: str, exp: str | None = None, experiment: str | None = None):
        return OmegaConf.create({"task": {"name": task}, "exp": exp, "tracking": {"experiment": experiment}})

    assert experiment_name(cfg("train")) == experiment_name(cfg("train", "fsdp4_tuned")) == "perflab"
    assert experiment_name(cfg("infer", "edge")) == "perflab-infer"
    assert experiment_name(cfg("profile", "profile")) == "perflab-profile"
    assert experiment_name(cfg("train", "fsdp4", experiment="mine")) == "mine"
