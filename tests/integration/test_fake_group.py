"""dist.fake: an N-rank run's rank 0 alone in one process, its collectives torch's fake ones. The
sharding is the N-rank run's (each parameter's local shard the size FSDP2 gives rank 0 of N), the
run goes through in one process with no launcher, and every record says the group was faked."""
from __future__ import annotations

import csv
import math
from pathlib import Path

import pytest
from mlflow import MlflowClient
from torch.distributed.tensor import DTensor

from src.compare import main as compare_main
from src.config.compose import ConfigError, compose_config
from src.config.validate import validate
from src.distributed.env import shutdown
from src.fusion.measure import shard_numels
from src.run import preflight
from src.runtime import RunContext
from src.train.trainer import Trainer
from tests.support.cli import read_summary, run_cli


@pytest.mark.parametrize("nproc", [2, 3])
def test_a_faked_group_shards_each_parameter_as_rank_0_of_that_group(tmp_path: Path, nproc: int):
    """3 ranks: most first dims (40, 160, the 256-token vocabulary; not qkv's 120) do not divide by 3, so those shards are FSDP2's padded ones."""
    cfg = compose_config([f"dist.nproc={nproc}", "dist.fake=true", "tracking=none", "model.dim=40", "model.n_heads=4"])
    trainer = Trainer(cfg, RunContext(run_dir=None, cwd=str(tmp_path)))
    try:
        trainer.build()
        params = list(trainer.model.parameters())
        assert all(isinstance(p, DTensor) and p.device_mesh.size() == nproc for p in params)
        assert [p.to_local().numel() for p in params] == shard_numels(cfg)
        assert sum(p.numel() for p in params) == trainer.n_params  # the global shapes are the model's
        assert trainer.env.world_size == nproc and trainer.env.rank == 0
        # the data is rank 0's share of an N-rank run's batches
        assert (trainer.batches.dp_rank, trainer.batches.dp_world) == (0, nproc)
    finally:
        shutdown()


def test_a_faked_two_gpu_run_trains_in_this_process_and_says_so(workdir: Path, capsys, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli(["dist.nproc=2", "dist.fake=true", "train.steps=4", "tracking.uri=sqlite:///mlflow.db"], workdir)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = read_summary(workdir)
    assert summary["settings"]["world_size"] == 2 and summary["settings"]["dist_fake"] is True
    assert summary["steps"] == 4 and math.isfinite(summary["final_loss"]) and summary["status"] == "finished"
    log = (next(workdir.glob("outputs/*/*/run.log"))).read_text()
    assert "fsdp2 over 2 rank(s) on cpu (rank 0 alone, collectives faked: dist.fake)" in log
    assert "dist.fake: rank 0 of 2 alone, no data between ranks" in log
    (run,) = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}").search_runs(["1"])
    assert run.data.params["dist.fake"] == "True" and run.data.tags["world_size"] == "2"
    assert run.data.tags["dist.fake"] == "rank 0 alone, collectives faked"
    # compare shows the ranks as faked, from the store and from the run folder
    for args in (["--uri", f"sqlite:///{workdir / 'mlflow.db'}"], ["--dirs", str(workdir / "outputs")]):
        assert compare_main([*args, "--width", "120"]) == 0
        assert "world_size=2 (faked)" in capsys.readouterr().out


def test_a_faked_two_node_group_runs_as_a_one_node_submitit_job(workdir: Path):
    """submitit's local executor (one node, as a SLURM job would be asked for) runs rank 0 of 2 nodes x 2
    alone; the sweep's table marks the ranks as faked."""
    proc = run_cli(["-m", "hydra/launcher=submitit_local", "tracking=none", "dist.nproc=2", "dist.nnodes=2", "dist.fake=true", "train.steps=2"], workdir)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (sweep_dir,) = workdir.glob("multirun/*/*")
    assert any(sweep_dir.glob(".submitit/*/*_submitted.pkl"))  # submitit ran the job
    assert "fsdp2 over 4 rank(s) on cpu (rank 0 alone, collectives faked: dist.fake)" in (sweep_dir / "0" / "run.log").read_text()
    (row,) = list(csv.DictReader((sweep_dir / "sweep.csv").open()))
    assert (row["status"], row["world_size"]) == ("finished", "4 (faked)")


H200 = {"cuda_device_count": 1, "mps_available": False, "cuda_capability": ((9, 0), "NVIDIA H200")}


def test_a_faked_group_needs_one_gpu_and_refuses_what_needs_the_other_ranks():
    two_gpu_fp8 = ["+exp=fsdp4_fp8", "dist.nproc=2"]
    with pytest.raises(ConfigError, match=r"dist.nproc=2 but only 1 GPU\(s\) are present; set dist.nproc=1 or less, or add dist.fake=true"):
        validate(compose_config(two_gpu_fp8), **H200)
    validate(compose_config([*two_gpu_fp8, "dist.fake=true"]), **H200)
    validate(compose_config([*two_gpu_fp8, "dist.nnodes=4", "dist.fake=true"]), **H200)  # 8 ranks, rank 0 here
    preflight(["dist.nproc=2", "dist.nnodes=2", "dist.fake=true"], multirun=False)  # no other node to meet: no endpoint asked for
    refusals = [
        (["dist.nproc=1", "dist.fake=true"], "dist.fake=true fakes a group of dist.nproc x dist.nnodes ranks, here 1; set dist.nproc=2 or more"),
        (["dist.fake=true", "checkpoint.enabled=true"], "nor load one; set checkpoint.enabled=false checkpoint.resume=none checkpoint.export_safetensors=false"),
        (["dist.fake=true", "checkpoint.export_safetensors=true"], "it can neither write a whole checkpoint (nor model.safetensors) nor load one"),
        (["dist.fake=true", "fault.kind=raise", "fault.rank=1"], "fault.rank=1 never runs under dist.fake=true (rank 0 alone); set fault.rank=0"),
        (["dist.fake=true", "sharding=none"], "dist.fake=true fakes FSDP2's group, and sharding=none replicates the model with DDP"),
        (["dist.fake=true", "+exp=diagnose"], "dist.fake=true fakes a training run's group, and task=diagnose runs in one process already; drop dist.fake"),
    ]
    for overrides, line in refusals:
        with pytest.raises(ConfigError, match=line.replace("(", r"\(").replace(")", r"\)")):
            validate(compose_config(overrides), cuda_device_count=0, mps_available=False)
    with pytest.raises(ConfigError, match="start it with `python -m src.run`, not torchrun or srun"):
        validate(compose_config(["dist.fake=true"]), cuda_device_count=0, mps_available=False, as_worker=True)
