"""The real command line, end to end on 2 CPU ranks: run directory, summary.json, MLflow, failures."""
from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from tests.support.cli import read_summary, run_cli

HEADLINE = ("tokens_per_s_per_device", "tokens_per_s", "mfu", "peak_mem_gb", "final_loss", "step_time_s", "mlflow_run_id")


def _client(cwd: Path) -> MlflowClient:
    return MlflowClient(tracking_uri=f"sqlite:///{cwd / 'mlflow.db'}")


def _runs(cwd: Path):
    client = _client(cwd)
    return client.search_runs([e.experiment_id for e in client.search_experiments()])


@pytest.fixture(scope="module")
def default_run(tmp_path_factory) -> Path:
    cwd = tmp_path_factory.mktemp("default")
    proc = run_cli(["train.steps=6"], cwd=cwd, launcher=["-c", LAUNCHER_IMPORTS])
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (cwd / "console.txt").write_text(proc.stdout)
    (cwd / "launcher.txt").write_text(proc.stderr)
    return cwd


# `python -m src.run ARGS` run through runpy, saying at its exit whether the launcher (not the ranks)
# imported MLflow: rank 0 makes the last line's view, so the launcher need not (about 2 s of CPU)
LAUNCHER_IMPORTS = ("import atexit, runpy, sys\n"
                    "atexit.register(lambda: print('launcher imported mlflow:', 'mlflow' in sys.modules, file=sys.stderr))\n"
                    "sys.argv = sys.argv[2:]\n"  # [-c, -m, src.run, ARGS]
                    "runpy.run_module('src.run', run_name='__main__', alter_sys=True)\n")


def test_default_run_writes_one_run_dir_with_summary(default_run: Path):
    run_dirs = list(default_run.glob("outputs/*/*"))
    assert len(run_dirs) == 1, run_dirs  # one Hydra output directory, not one per rank
    summary = read_summary(default_run)
    assert summary["task"] == "train" and summary["status"] == "finished"
    for key in HEADLINE:
        assert key in summary, key
    s = summary["settings"]
    assert (s["model"], s["sharding"], s["precision"], s["backend"], s["world_size"]) == ("tiny", "fsdp2", "bf16", "cpu", 2)
    # speed=copies' recipes are measured on GPUs: a CPU run trains through torch's own FSDP2, nothing replaced
    assert s["speed"] == "copies" and summary["speed_recipes"] == [] and summary["torch_version"]
    # the default trains on text, so the loss falls from ln(256) = 5.55 (random tokens stay there)
    assert s["data"] == "text" and summary["final_loss"] < summary["initial_loss"] - 0.02, summary
    console = (default_run / "console.txt").read_text().splitlines()
    assert console[0].startswith("perflab: composing")  # printed before torch is imported
    assert f"outputs: {run_dirs[0].relative_to(default_run)}/" in console[-2]
    assert "mlflow ui --backend-store-uri sqlite:///mlflow.db" in console[-1]
    # the GPU-only levers say nothing on a CPU run, where none was asked for
    log = (default_run / "console.txt").read_text() + (default_run / "launcher.txt").read_text()
    assert not [line for line in log.splitlines() if "speed." in line and "off in this run" in line], log[-3000:]
    # the saved view of the task's runs (src/tracking/ui_view.py), made by rank 0 and printed by the launcher
    assert "viewStateShareKey=perflab-train" in console[-1] and "mlflow_hint" not in summary
    assert "launcher imported mlflow: False" in (default_run / "launcher.txt").read_text()
    assert summary["mfu"] is None  # no peak-FLOPS figure for a CPU: not applicable, not invented
    assert summary["gpu_sm_clock_mhz"] is None and summary["gpu_power_capped_frac"] is None  # no GPU clock to sample
    assert summary["tokens_per_s"] == pytest.approx(2 * summary["tokens_per_s_per_device"])
    assert summary["steps"] == 6 and summary["final_loss"] > 0 and summary["peak_mem_gb"] > 0
    assert 0 <= summary["overhead_frac"] < 0.2
    assert (run_dirs[0] / "config.yaml").exists() and (run_dirs[0] / "run.log").read_text().count("step ") >= 6


def test_default_run_is_in_mlflow_with_params_metrics_and_tags(default_run: Path):
    (run,) = _runs(default_run)
    summary = read_summary(default_run)
    assert run.info.run_id == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.params["model.name"] == "tiny" and run.data.params["dist.nproc"] == "2"
    assert run.data.params["precision.param_dtype"] == "bfloat16"
    assert run.data.tags["world_size"] == "2" and run.data.tags["device"] == "cpu" and "torch" in run.data.tags
    import torch

    assert run.data.tags["cuda"] == (torch.version.cuda or "none")  # a CPU build's tag reads none, not Python's None
    history = _client(default_run).get_metric_history(run.info.run_id, "loss")
    assert [m.step for m in history] == list(range(6))
    assert run.data.metrics["summary.tokens_per_s_per_device"] == pytest.approx(summary["tokens_per_s_per_device"])
    artifacts = {a.path for a in _client(default_run).list_artifacts(run.info.run_id)}
    assert {"summary.json", "config.yaml"} <= artifacts
    assert "mlflow.sharedViewState.perflab-train" in _client(default_run).get_experiment(run.info.experiment_id).tags
    # MFU in both conventions, energy and price: n/a on a CPU, each with its reason, in the run too
    assert all(summary[k] is None for k in ("mfu", "mfu_causal", "joules_per_token", "cost_per_mtok"))
    assert set(summary["na"]) == {"mfu", "mfu_causal", "joules_per_token", "cost_per_mtok"}
    assert run.data.tags["na.joules_per_token"] == summary["na"]["joules_per_token"] and "GPU power" in summary["na"]["joules_per_token"]


def test_fsdp4_experiment_on_cpu_prints_the_seed_line(workdir: Path):
    proc = run_cli(["+exp=fsdp4", "backend=cpu", "model=tiny", "dist.nproc=2", "data.seq_len=256", "tracking=none"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    seed_lines = [line for line in proc.stdout.splitlines() if line.startswith("Step ")]
    assert len(seed_lines) == 5
    assert seed_lines[0].startswith("Step 0 | Loss: ") and seed_lines[-1].endswith(" GB")
    summary = read_summary(workdir)
    assert summary["settings"]["exp"] == "fsdp4" and summary["mlflow_run_id"] is None
    assert not (workdir / "mlflow.db").exists()


def test_text_corpus_loss_falls(workdir: Path):
    # fp32: this CPU has no bf16 arithmetic, so a bf16 step took 0.8 s against 0.05-0.07 (40 steps: 43 s
    # against 14 alone); the default bf16 path is test_default_run_writes_one_run_dir_with_summary's
    proc = run_cli(["data=text", "sharding=none", "dist.nproc=1", "train.steps=40", "optim.lr=3e-3", "tracking=none", "model.dim=128", "precision=fp32"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(workdir)
    assert summary["settings"]["world_size"] == 1
    # bytes start at ln(256) = 5.55 nats; 40 steps of real text get well under 3.5
    assert summary["initial_loss"] > 5.0 and summary["final_loss"] < 3.5, summary


def test_a_crashing_rank_fails_the_run_with_its_rank_and_error(workdir: Path, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli(["fault.kind=raise", "fault.rank=1", "fault.step=2", "train.steps=5", "tracking.system_metrics=false"], cwd=workdir)
    assert proc.returncode == 1
    # one line on the console; the elastic agent's traceback goes to run.log
    assert proc.stderr.splitlines() == ["error: rank 1 failed: InjectedFault: injected fault at step 2"], proc.stderr
    (run_dir,) = [p.parent for p in workdir.glob("outputs/*/*/summary.json")]
    assert "Traceback" in (run_dir / "run.log").read_text()
    # one step numbering: the console, metrics.jsonl and the error all count from 0
    assert "step 1 [2/5] | loss" in proc.stdout and "step 2 [" not in proc.stdout
    assert [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()] == [0, 1]
    summary = read_summary(workdir)
    assert summary["status"] == "failed" and "rank 1" in summary["error"]
    (run,) = _runs(workdir)
    assert run.info.status == "FAILED" and "injected fault" in run.data.tags["error"]
    assert [m.step for m in _client(workdir).get_metric_history(run.info.run_id, "loss")] == [0, 1]
    # a FAILED run keeps what its run directory holds, run.log above all
    artifacts = {a.path for a in _client(workdir).list_artifacts(run.info.run_id)}
    assert {"run.log", "summary.json", "config.yaml", "metrics.jsonl"} <= artifacts


def test_a_killed_rank_0_leaves_no_mlflow_run_running(workdir: Path, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli(["fault.kind=kill", "fault.rank=0", "fault.step=1", "train.steps=4"], cwd=workdir)
    assert proc.returncode == 1
    assert "error: rank 0 failed: killed by signal SIGKILL" in proc.stderr.splitlines()
    (run,) = _runs(workdir)
    assert run.info.status == "FAILED"


def test_under_torchrun_the_entry_is_a_worker_and_rank_0_owns_the_run_dir(workdir: Path):
    proc = run_cli(
        ["train.steps=3", "tracking=none", "checkpoint.enabled=true"], cwd=workdir,
        launcher=["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"],
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summaries = list(workdir.glob("outputs/*/*/summary.json"))
    assert len(summaries) == 1
    summary = json.loads(summaries[0].read_text())
    assert summary["settings"]["world_size"] == 2 and summary["steps"] == 3
    # every rank wrote its shard into rank 0's run directory
    ckpt = summaries[0].parent / "checkpoints" / "step_00000003"
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == ["__0_0.distcp", "__1_0.distcp"]


@pytest.mark.parametrize("target", ["group", "launcher"])
def test_ctrl_c_ends_the_run_killed_with_every_logged_step(workdir: Path, target: str, mlflow_store):
    """SIGINT to the whole process group (a terminal's Ctrl-C), or to the launcher alone."""
    import signal
    import subprocess
    import time

    from tests.support.cli import REPO

    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    mlflow_store(workdir)
    proc = subprocess.Popen(
        [sys.executable, "-m", "src.run", "train.steps=100000", "tracking.system_metrics=false"],
        cwd=workdir, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 180
        metrics = []
        while time.monotonic() < deadline and len(metrics) < 2:  # until 2 steps are on record
            time.sleep(0.3)
            files = list(workdir.glob("outputs/*/*/metrics.jsonl"))
            metrics = files[0].read_text().splitlines() if files else []
        assert len(metrics) >= 2, "the run never started"
        (os.killpg if target == "group" else os.kill)(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err
    (line,) = err.splitlines()  # no traceback from Hydra, the agent or the metric writer
    assert line.startswith("error: interrupted by SIGINT; the run in ") and line.endswith("is recorded as KILLED")
    (run,) = _runs(workdir)
    assert run.info.status == "KILLED"
    assert read_summary(workdir)["status"] == "killed"
    # the metric writer drained its queue before it exited: every step metrics.jsonl holds is in MLflow
    logged = [json.loads(m)["step"] for m in next(workdir.glob("outputs/*/*/metrics.jsonl")).read_text().splitlines()]
    assert [m.step for m in _client(workdir).get_metric_history(run.info.run_id, "loss")] == logged
    # no orphans: nothing started from this run is left (ranks, the writer)
    deadline = time.monotonic() + 15  # a few seconds' grace for processes already on their way out
    while True:
        left = subprocess.run(["ps", "-o", "pid=,args=", "-s", str(proc.pid)], capture_output=True, text=True).stdout.strip()
        if not left or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    assert left == "", left


def test_system_metrics_have_a_first_and_a_last_sample_even_in_a_short_run(workdir: Path, mlflow_store):
    # 3 steps take well under the default 10 s interval, after which MLflow's own sampler first logs
    mlflow_store(workdir)
    proc = run_cli(["dist.nproc=1", "sharding=none", "train.steps=3"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run,) = _runs(workdir)
    assert "system/system_memory_usage_megabytes" in run.data.metrics
    history = _client(workdir).get_metric_history(run.info.run_id, "system/cpu_utilization_percentage")
    assert sorted(m.step for m in history) == [0, 1]


def test_runs_started_together_from_one_folder_get_a_folder_each_and_both_land_in_its_new_store(tmp_path: Path):
    """The default folders name the second a run starts: two commands of the same second once
    shared one (interleaved metrics.jsonl, one's config, the other's summary in both MLflow runs).
    And both make the folder's new SQLite store at once: MLflow's schema migration raced (one died
    with "table ... already exists" or "duplicate column name"); the store is now made under a lock."""
    import subprocess

    from tests.support.cli import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "src.run", "train.steps=2", "dist.nproc=1", "tracking.system_metrics=false"]
    procs = [subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for _ in range(2)]
    outs = [p.communicate(timeout=300)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    folders = sorted(p.parent for p in tmp_path.glob("outputs/*/*/summary.json"))
    assert len(folders) == 2
    summaries = [json.loads((f / "summary.json").read_text()) for f in folders]
    assert all(len((f / "metrics.jsonl").read_text().splitlines()) == 2 for f in folders)
    assert len({s["mlflow_run_id"] for s in summaries}) == 2
    client = _client(tmp_path)
    runs = client.search_runs([client.get_experiment_by_name("perflab").experiment_id])
    assert sorted(r.info.status for r in runs) == ["FINISHED", "FINISHED"]
    for s in summaries:  # each MLflow run holds its own folder's summary, not the other's
        stored = json.loads(Path(client.download_artifacts(s["mlflow_run_id"], "summary.json", str(tmp_path))).read_text())
        assert stored["mlflow_run_id"] == s["mlflow_run_id"]


def test_a_new_run_folder_is_claimed_by_one_process_only(tmp_path: Path):
    from concurrent.futures import ThreadPoolExecutor

    from src.run import claim_folder

    (tmp_path / "outputs" / "d" / "t").mkdir(parents=True)  # a run of the same second before
    assert claim_folder(tmp_path / "outputs" / "d" / "t").name == "t-2"
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda _: claim_folder(tmp_path / "outputs" / "d" / "u"), range(8)))
    assert sorted(p.name for p in got) == sorted(["u", *(f"u-{n}" for n in range(2, 9))])
