"""Hydra multiruns as MLflow parent/child runs, failures inside a sweep, and src.compare."""
from __future__ import annotations

import csv
import json
from pathlib import Path

import pytest
from mlflow import MlflowClient

from src.compare import main as compare_main
from tests.support.cli import run_cli

FAST = ["dist.nproc=1", "train.steps=2", "tracking.system_metrics=false"]  # one in-process rank per job


def _runs(cwd: Path):
    client = MlflowClient(f"sqlite:///{cwd / 'mlflow.db'}")
    return client, client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.fixture(scope="module")
def sweep(tmp_path_factory, mlflow_store) -> Path:
    cwd = tmp_path_factory.mktemp("sweep")
    mlflow_store(cwd)
    proc = run_cli(["-m", "precision=fp32,bf16", "sharding=none,fsdp2", *FAST], cwd=cwd, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd


def test_a_2x2_sweep_is_one_parent_with_four_finished_children(sweep: Path):
    client, runs = _runs(sweep)
    parents = [r for r in runs if r.data.tags.get("sweep") == "true"]
    assert len(parents) == 1
    parent = parents[0]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert len(children) == 4 and len(runs) == 5
    assert all(c.info.status == "FINISHED" for c in children)
    combos = {(c.data.params["precision.name"], c.data.params["sharding.name"]) for c in children}
    assert combos == {("fp32", "none"), ("fp32", "fsdp2"), ("bf16", "none"), ("bf16", "fsdp2")}
    # named by what varies, shortest first: a group's option by itself, so that the four are told
    # apart within the 25 characters MLflow's runs table shows of a name
    assert {c.info.run_name for c in children} == {f"{p} {s}" for p, s in combos}
    assert parent.data.params["precision.name"] == "fp32,bf16" and parent.data.params["sharding.name"] == "none,fsdp2"
    assert parent.data.metrics["summary.tokens_per_s_per_device"] == max(c.data.metrics["summary.tokens_per_s_per_device"] for c in children)
    assert parent.info.status == "FINISHED" and parent.data.tags["jobs"] == "4 finished, 0 failed"
    assert parent.data.metrics["jobs_finished"] == 4 and parent.data.metrics["jobs_failed"] == 0
    assert {a.path for a in client.list_artifacts(parent.info.run_id)} == {"sweep.csv", "sweep.png"}
    # sweep output lands in multirun/, one directory per job
    (sweep_dir,) = list(sweep.glob("multirun/*/*"))
    assert sorted(p.name for p in sweep_dir.iterdir() if p.is_dir()) == ["0", "1", "2", "3"]
    rows = list(csv.DictReader(open(sweep_dir / "sweep.csv")))
    assert [r["status"] for r in rows] == ["finished"] * 4 and all(float(r["tokens_per_s_per_device"]) > 0 for r in rows)
    assert "decode_p50_ms" not in rows[0] and "share_memory_bound" not in rows[0]  # a training sweep's columns only


def test_compare_prints_the_sweep_with_the_best_run_marked(sweep: Path, capsys, monkeypatch):
    monkeypatch.chdir(sweep)
    assert compare_main(["--sweep", "latest", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "4 train runs by tokens_per_s_per_device (higher is better, sweep objective)" in out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    header = next(line for line in out.splitlines() if "tok/s/dev" in line)
    assert header.index("tok/s/dev") < header.index("loss") < header.index("run")  # the figures first
    lines = [line for line in out.splitlines() if "fp32 " in line or "bf16 " in line]
    assert len(lines) == 4 and "★" in lines[0] and sum("★" in line for line in lines) == 1
    for combo in ("fp32 none", "bf16 fsdp2"):
        assert any(combo in line for line in lines)
    # with no argument: the newest task's runs, the same four
    assert compare_main(["--width", "80"]) == 0
    assert "4 train runs by tokens_per_s_per_device (higher is better)" in capsys.readouterr().out
    # the same table from the run directories alone, no tracking store
    assert compare_main(["--dirs", "multirun", "--metric", "final_loss", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "4 train runs by final_loss (lower is better)" in out and "…" not in out


def test_a_failing_job_is_failed_and_the_sweep_goes_on(workdir: Path, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli(["-m", "fault.kind=raise,none", "fault.rank=0", "fault.step=1", *FAST], cwd=workdir, timeout=300)
    assert proc.returncode == 1  # the sweep finished, and says a job failed
    assert "job 0 (fault.kind=raise" in proc.stdout + proc.stderr
    client, runs = _runs(workdir)
    parent = next(r for r in runs if r.data.tags.get("sweep") == "true")
    children = {r.data.params["fault.kind"]: r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id}
    assert children["raise"].info.status == "FAILED" and "injected fault at step 1" in children["raise"].data.tags["error"]
    assert children["none"].info.status == "FINISHED"
    assert parent.data.tags["jobs"] == "1 finished, 1 failed" and parent.info.status == "FINISHED"


def test_parallel_sweeps_on_sqlite_are_refused_before_they_start(workdir: Path):
    proc = run_cli(["-m", "hydra/launcher=joblib", "precision=fp32,bf16"], cwd=workdir, timeout=120)
    assert proc.returncode == 2
    assert "takes one writer at a time" in proc.stderr and "tracking.uri=http://127.0.0.1:5000" in proc.stderr
    assert list(workdir.iterdir()) == []


def _infer_job(root: Path, name: str, dtype: str, decode_p50_ms: float) -> None:
    job = root / name
    job.mkdir(parents=True)
    summary = {"task": "infer", "status": "finished", "settings": {"backend": "vulkan"}, "decode_p50_ms": decode_p50_ms,
               "decode_tokens_per_s": 1000 / decode_p50_ms, "ttft_p50_ms": 3 * decode_p50_ms, "prefill_tokens_per_s": 900.0, "rel_err": 1e-3}
    (job / "summary.json").write_text(json.dumps(summary))


def test_compare_knows_latencies_are_lower_is_better_and_shows_edge_figures(tmp_path: Path, capsys):
    _infer_job(tmp_path, "backend=vulkan edge.batch=1 edge.dtype=fp16", "fp16", 4.0)
    _infer_job(tmp_path, "backend=vulkan edge.batch=1 edge.dtype=fp32", "fp32", 9.0)
    assert compare_main(["--dirs", str(tmp_path), "--metric", "decode_p50_ms", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "2 infer runs by decode_p50_ms (lower is better)" in out and "n/a" not in out
    assert max(len(line) for line in out.splitlines()) <= 80 and "…" not in out
    (fast,) = [line for line in out.splitlines() if "edge.dtype=fp16" in line]
    assert "★" in fast and "4" in fast and "250" in fast  # decode tok/s shown beside the latency
    assert any("edge.dtype=fp32" in line and "★" not in line for line in out.splitlines())
    # a relative error of 4.906e-07 whole, never cut to "4.906…" (which reads as 4.9); the figures
    # that do not fit 80 columns are named under the table
    summary = json.loads((tmp_path / "backend=vulkan edge.batch=1 edge.dtype=fp16" / "summary.json").read_text())
    (tmp_path / "backend=vulkan edge.batch=1 edge.dtype=fp16" / "summary.json").write_text(json.dumps({**summary, "rel_err": 4.906e-07}))
    assert compare_main(["--dirs", str(tmp_path), "--metric", "rel_err", "--width", "80"]) == 0
    out = capsys.readouterr().out
    assert "4.906e-07" in out and "…" not in out and max(len(line) for line in out.splitlines()) <= 80


def test_compare_with_no_store_creates_none_and_names_uri(tmp_path: Path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert compare_main([]) == 2
    err = capsys.readouterr().err
    assert "--uri" in err and "python -m src.run" in err and len(err.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []  # no mlflow.db left behind
    assert compare_main(["--uri", f"sqlite:///{tmp_path}"]) == 2  # a folder named as the store: at once, not after MLflow's retries
    err = capsys.readouterr().err
    assert err.startswith(f"error: --uri sqlite:///{tmp_path}: {tmp_path} is a folder, not a database file") and len(err.strip().splitlines()) == 1


def test_each_task_declares_its_figures_beside_it():
    from src.tasks import TASKS
    from src.tracking.figures import figures_of, headline

    assert {task: headline(task) for task in TASKS} == {
        "train": "tokens_per_s_per_device", "profile": "tokens_per_s_per_device", "diagnose": "share_memory_bound",
        "kernel_bench": "tokens_per_s_per_device", "infer": "decode_tokens_per_s",
    }
    assert [task for task in TASKS if figures_of(task).sweep_plots] == ["infer"]
    assert figures_of("kernel_bench").shown == ()  # its figures are its table's rows


def test_an_in_process_job_leaves_its_model_free_for_the_next(tmp_path: Path, monkeypatch):
    """A sweep's jobs run one after another in this process: each job's model, optimizer and trainer
    must be gone when it returns, not left in reference cycles for the next job to count in its
    peak memory (and, on a GPU, to run out of it). Checked without a collection of the test's own."""
    import weakref

    from src.config.compose import compose_config
    from src.runtime import RunContext
    from src.train import trainer as trainer_module
    from src.train.worker import train

    refs = []
    build = trainer_module.Trainer.build

    def recording_build(self):
        build(self)
        refs.extend([weakref.ref(self), weakref.ref(self.model), weakref.ref(self.optimizer)])

    monkeypatch.setattr(trainer_module.Trainer, "build", recording_build)
    for overrides in (["dist.nproc=1"], ["dist.nproc=2", "dist.fake=true"]):
        refs.clear()
        summary = train(compose_config([*overrides, "tracking=none", "train.steps=2"]), RunContext(run_dir=None, cwd=str(tmp_path)))
        assert summary["steps"] == 2 and len(refs) == 3
        assert [r() for r in refs] == [None, None, None], overrides


def test_a_jobs_config_hash_leaves_out_where_and_how_it_runs():
    from src.config.compose import compose_config
    from src.tracking.resume import config_hash

    base = config_hash(compose_config(["precision=fp32"]))
    # the store, the sweep's own settings and the rest of tracking.* change no figure of the job
    assert config_hash(compose_config(["precision=fp32", "tracking.uri=http://127.0.0.1:5000", "sweep.resume=true", "sweep.objective=final_loss",
                                       "tracking.system_metrics=false"])) == base
    assert config_hash(compose_config(["precision=bf16"])) != base
    assert config_hash(compose_config(["precision=fp32", "optim.lr=1e-3"])) != base


def _children(client, parent_id: str) -> dict[str, object]:
    """The parent's live (not deleted) children by the precision they ran."""
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()], f"tags.mlflow.parentRunId = '{parent_id}'")
    return {r.info.run_name.removeprefix("precision="): r for r in runs}  # a run killed at its start may have no params yet


def test_a_killed_sweep_resumed_runs_only_what_did_not_finish(workdir: Path, mlflow_store):
    """The sweep's own process killed (kill -9, a lost login node) while its second job trains: the
    first job FINISHED, the second's run left RUNNING, the parent too. The same command with
    sweep.resume=true reopens that parent, skips the first job by its config_hash and runs the
    second; then a child deleted from the store is a job never run, and the next resume runs it alone."""
    import os
    import subprocess
    import sys
    import time

    from tests.support.cli import REPO

    args = ["-m", "precision=fp32,bf16", *FAST]
    mlflow_store(workdir)
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("HYDRA_FULL_ERROR", None)
    proc = subprocess.Popen([sys.executable, "-m", "src.run", *args], cwd=workdir, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while proc.poll() is None and time.monotonic() < deadline:
        if list(workdir.glob("multirun/*/*/1/.mlflow_run_id")):  # job 1 has its MLflow run and is training
            proc.kill()
            break
        time.sleep(0.02)
    assert proc.wait(timeout=60) == -9, proc.stderr.read()
    client, runs = _runs(workdir)
    (parent,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    first = _children(client, parent.info.run_id)
    assert first["fp32"].info.status == "FINISHED" and first["fp32"].data.tags["config_hash"]
    assert first["bf16"].info.status == "RUNNING" and parent.info.status == "RUNNING"

    proc = run_cli([*args, "sweep.resume=true"], cwd=workdir, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    fp32 = first["fp32"].info.run_id
    assert f"job 0 (fp32): skipped, it finished before as MLflow run {fp32[:8]} (config_hash {first['fp32'].data.tags['config_hash']})" in out
    assert "job 1 (bf16): skipped" not in out and "sweep.resume: 1 job(s) skipped, finished before: job 0 (fp32)" in out
    client, runs = _runs(workdir)
    (again,) = [r for r in runs if r.data.tags.get("sweep") == "true"]
    assert again.info.run_id == parent.info.run_id and again.info.status == "FINISHED" and again.data.tags["resumes"] == "1"
    assert again.data.tags["jobs"] == "2 finished, 0 failed (1 skipped: finished before)"
    second = _children(client, parent.info.run_id)
    assert len(runs) == 3 and {k: r.info.status for k, r in second.items()} == {"fp32": "FINISHED", "bf16": "FINISHED"}
    assert second["fp32"].info.run_id == fp32 and second["bf16"].info.run_id != first["bf16"].info.run_id
    # the run the rerun replaced: out of the sweep (deleted, restorable), pointing at its successor
    zombie = client.get_run(first["bf16"].info.run_id)
    assert zombie.info.lifecycle_stage == "deleted" and zombie.data.tags["superseded_by"] == second["bf16"].info.run_id
    assert zombie.info.status == "KILLED"
    (latest,) = [d for d in sorted(workdir.glob("multirun/*/*")) if (d / "sweep.csv").exists()][-1:]
    assert json.loads((latest / "0" / "summary.json").read_text())["skipped"] == f"finished before as MLflow run {fp32}"
    assert [r["status"] for r in csv.DictReader(open(latest / "sweep.csv"))] == ["finished", "finished"]

    client.delete_run(fp32)  # a job missing from the store
    proc = run_cli([*args, "sweep.resume=true"], cwd=workdir, timeout=300)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "job 1 (bf16): skipped" in out and "job 0 (fp32): skipped" not in out
    third = _children(client, parent.info.run_id)
    assert {k: r.info.status for k, r in third.items()} == {"fp32": "FINISHED", "bf16": "FINISHED"}
    assert third["bf16"].info.run_id == second["bf16"].info.run_id and third["fp32"].info.run_id != fp32
    assert client.get_run(parent.info.run_id).data.tags["resumes"] == "2"


def test_compare_answers_what_it_cannot_show_in_one_line(sweep: Path, tmp_path: Path, capsys, monkeypatch):
    """An unknown --sweep, a run that is no sweep's parent, a misspelt --metric: one line each, exit 2;
    a cut-off summary.json among run folders is left out, saying so, and the rest compared."""
    import shutil

    monkeypatch.chdir(sweep)
    client, runs = _runs(sweep)
    child = next(r for r in runs if r.data.tags.get("mlflow.parentRunId"))
    for args, said in ((["--sweep", "0123456789abcdef"], "--sweep 0123456789abcdef: no such run at "),
                       (["--sweep", child.info.run_id], f"--sweep {child.info.run_id}: run {child.info.run_name!r} is not a sweep's parent run"),
                       (["--sweep", "latest", "--metric", "finl_loss"], "--metric finl_loss: no run here has it; they have: ")):
        assert compare_main(args) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"error: {said}") and len(err.strip().splitlines()) == 1, err
    runs_dir = tmp_path / "runs"
    shutil.copytree(sweep / "multirun", runs_dir)
    cut = sorted(runs_dir.glob("*/*/0/summary.json"))[0]
    cut.write_text(cut.read_text()[:20])
    assert compare_main(["--dirs", str(runs_dir), "--width", "80"]) == 0
    out = capsys.readouterr()
    assert f"warning: {cut}: cut off or not JSON" in out.err and "3 train runs" in out.out
