"""Several nodes on one machine: two elastic agents on 127.0.0.1 as two "nodes" (c10d rendezvous, one
gloo rank each) train as one 2-rank run. Real agents: torchrun's own (README's multi-node line), and
perflab's (`dist.nnodes=2`, what a SLURM job runs on each node), whose restarts span the nodes."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from mlflow import MlflowClient

from src.config.compose import ConfigError, compose_config
from src.run import adopt_torchrun_shape, preflight
from tests.support.cli import REPO, read_summary, run_cli

# fp32 so that "equal" means equal: the same 2 ranks, the same reduction order, the same bits.
from tests.support.servers import free_port

# fp32 so that "equal" means equal: the same 2 ranks, the same reduction order, the same bits.
RUN = ["data=random", "precision=fp32", "train.steps=4", "tracking.system_metrics=false"]


def _losses(metrics: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, metrics.read_text().splitlines())}


def _two_nodes(commands: list[list[str]], cwd: Path, timeout: int = 240) -> list[subprocess.CompletedProcess]:
    """Start one command per "node" at once (they wait for each other at the rendezvous)."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])))
    procs = [subprocess.Popen([sys.executable, *cmd], cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for cmd in commands]
    done = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=timeout)
            done.append(subprocess.CompletedProcess(proc.args, proc.returncode, out, err))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return done


@pytest.fixture(scope="module")
def single_node(tmp_path_factory) -> dict[int, float]:
    """The same run on one node: 2 ranks started by the elastic launcher (dist.nproc=2, the default)."""
    cwd = tmp_path_factory.mktemp("single")
    proc = run_cli([*RUN, "tracking=none"], cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (metrics,) = cwd.glob("outputs/*/*/metrics.jsonl")
    return _losses(metrics)


def test_two_torchrun_agents_on_loopback_train_as_one_two_rank_run(workdir: Path, single_node: dict[int, float], mlflow_store):
    mlflow_store(workdir)
    endpoint = f"127.0.0.1:{free_port()}"
    torchrun = ["-m", "torch.distributed.run", "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d",
                f"--rdzv-endpoint={endpoint}", "--rdzv-id=two-nodes", "--monitor-interval=0.5", "-m", "src.run", *RUN]
    nodes = _two_nodes([torchrun, torchrun], workdir)
    assert all(n.returncode == 0 for n in nodes), "\n".join(n.stdout[-2000:] + n.stderr[-2000:] for n in nodes)
    (run_dir,) = [p.parent for p in workdir.glob("outputs/*/*/summary.json")]  # one run directory, rank 0's
    summary = read_summary(workdir)
    assert summary["status"] == "finished" and summary["settings"]["world_size"] == 2
    assert _losses(run_dir / "metrics.jsonl") == single_node  # bit for bit the single-node 2-rank run
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # from global rank 0 only
    assert run.info.run_id == summary["mlflow_run_id"] and run.info.status == "FINISHED"
    assert run.data.tags["world_size"] == "2"
    # torchrun's shape, as it ran, in the run's config and params (not dist.nproc's default of 2)
    assert (run.data.params["dist.nnodes"], run.data.params["dist.nproc"]) == ("2", "1")
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2, 3]


def test_a_rank_killed_on_one_node_restarts_both_and_resumes_from_the_last_checkpoint(workdir: Path, single_node: dict[int, float],
                                                                                     mlflow_store):
    """perflab's agent on each node (what a submitit task runs): rank 1, the second node's, is
    SIGKILLed at step 3; both nodes restart their ranks, which resume from step 2's checkpoint."""
    run_dir = workdir / "run"  # one folder for both nodes, as a cluster's shared filesystem gives
    mlflow_store(workdir)
    node = ["-m", "src.run", *RUN, "dist.nnodes=2", "dist.nproc=1", f"dist.rdzv_endpoint=127.0.0.1:{free_port()}", "dist.max_restarts=1",
            "checkpoint.enabled=true", "checkpoint.interval=2", "fault.kind=kill", "fault.rank=1", "fault.step=3", f"hydra.run.dir={run_dir}"]
    nodes = _two_nodes([node, node], workdir)
    assert all(n.returncode == 0 for n in nodes), "\n".join(n.stdout[-2000:] + n.stderr[-2000:] for n in nodes)
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["settings"]["world_size"] == 2
    assert summary["start_step"] == 2 and summary["resumed_from"].endswith("step_00000002")
    assert _losses(run_dir / "metrics.jsonl") == single_node  # steps 0-3 once each, as if nothing had happened
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])  # the same run went on
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1" and "error" not in run.data.tags
    assert "restart_1.cause" in run.data.tags and run.data.tags["world_size"] == "2"
    assert [m.step for m in client.get_metric_history(run.info.run_id, "loss")] == [0, 1, 2, 3]


def test_settings_that_cannot_meet_across_nodes_are_refused_in_one_line(monkeypatch, tmp_path: Path):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"^dist.nnodes=2 needs dist.rdzv_endpoint=HOST:PORT"):
        preflight(["dist.nnodes=2"], multirun=False)
    # under torchrun its flags decide: a dist.* override that says otherwise would be ignored
    for name, value in {"LOCAL_WORLD_SIZE": "1", "GROUP_WORLD_SIZE": "2", "TORCHELASTIC_MAX_RESTARTS": "0"}.items():
        monkeypatch.setenv(name, value)
    cfg = compose_config(["dist.nproc=4"])
    with pytest.raises(ConfigError, match=r"^dist.nproc=4: under torchrun, its --nproc-per-node decides \(1 here\)"):
        adopt_torchrun_shape(cfg, ["dist.nproc=4"])
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", "1")
    with pytest.raises(ConfigError, match=r"restarts across nodes need perflab's own agents; run `python -m src.run dist.nnodes=2"):
        adopt_torchrun_shape(compose_config([]), [])
    assert list(tmp_path.iterdir()) == []
