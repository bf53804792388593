"""kernels=auto: the fused variants follow a diagnosis; the choice is logged; no diagnosis, one line."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from src.compose import ConfigError, compose_config
from src.kernel_choice import auto_choice, choose
from tests.conftest import run_cli

FIXTURE = Path(__file__).parent / "fixtures" / "mini_llm_h200_diagnosis.json"
TINY = ["model=tiny", "train.steps=3", "data.batch_size=2", "data.seq_len=16", "dist.nproc=1", "precision=fp32"]


def _with_verdicts(tmp_path: Path, verdicts: dict[str, tuple[str, str]]) -> Path:
    """The fixture with every op compute-bound except the keys given (key -> (bound, limiter))."""
    d = json.loads(FIXTURE.read_text())
    for op in d["ops"]:
        op["bound"], op["limiter"] = verdicts.get(op["key"], ("compute-bound", "sm"))
    path = tmp_path / "diagnosis.json"
    path.write_text(json.dumps(d))
    return path


def test_auto_picks_exactly_the_memory_bound_and_latency_limited_ops_of_the_fixture():
    # mini_llm's step on one H200: SiLU and the backward softmax memory-bound, the norms, residual
    # adds and the loss's softmax latency-limited; GEMMs (compute-bound), flash attention and the
    # loss kernels (occupancy-limited) are left alone, as are fills and casts (no fused variant).
    choice = choose(FIXTURE)
    assert set(choice.ops) == {"swiglu", "softmax", "rms_norm", "cross_entropy"}
    assert choice.device == "NVIDIA H200"
    assert "layers.*.ffn/silu: memory-bound" in " ".join(choice.ops["swiglu"])
    assert any(line.startswith("loss/softmax: neither (latency)") for line in choice.ops["cross_entropy"])


def test_auto_follows_the_verdicts_not_the_op_names(tmp_path):
    only_silu = _with_verdicts(tmp_path, {"layers.*.ffn/silu": ("memory-bound", "hbm")})
    assert set(choose(only_silu).ops) == {"swiglu"}
    occupancy = _with_verdicts(tmp_path, {"layers.*.norm1/rms_norm": ("neither", "occupancy")})
    assert choose(occupancy).ops == {}
    both = _with_verdicts(tmp_path, {"add": ("memory-bound", "hbm"), "loss/softmax": ("neither", "latency")})
    assert set(choose(both).ops) == {"rms_norm", "cross_entropy"}


def test_without_a_diagnosis_auto_names_the_command_that_makes_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"none is under ./outputs or ./multirun; make one with `python -m src.run \+exp=diagnose model=tiny backend=cuda"):
        auto_choice(compose_config(["kernels=auto", "model=tiny"]), tmp_path)
    proc = run_cli(["kernels=auto", *TINY], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: kernels=auto reads a diagnosis of model=tiny")
    assert not (tmp_path / "outputs").exists()
    proc = run_cli(["kernels=auto", "kernels.diagnosis=nowhere.json", *TINY], cwd=tmp_path)
    assert proc.returncode == 2 and "kernels.diagnosis=nowhere.json: no diagnosis.json there" in proc.stderr


def test_auto_finds_this_models_diagnosis_swaps_its_ops_and_logs_why(tmp_path):
    # A diagnose run of model=tiny as task=diagnose leaves it: RUN/config.yaml, RUN/diagnose/diagnosis.json.
    run = tmp_path / "outputs" / "2026-11-30" / "00-00-00"
    (run / "diagnose").mkdir(parents=True)
    shutil.copy(_with_verdicts(tmp_path, {"layers.*.norm2/rms_norm": ("neither", "latency"), "silu": ("memory-bound", "hbm")}), run / "diagnose" / "diagnosis.json")
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose_config(["model=tiny", "task=diagnose"])))
    other = tmp_path / "multirun" / "x" / "0"  # a newer diagnosis of another model is not taken
    (other / "diagnose").mkdir(parents=True)
    shutil.copy(FIXTURE, other / "diagnose" / "diagnosis.json")
    (other / "config.yaml").write_text(OmegaConf.to_yaml(compose_config(["model=mini_llm"])))

    proc = run_cli(["kernels=auto", *TINY], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "fused Triton kernels: rms_norm x4, swiglu x0" in out
    assert "swiglu  (this model has none to swap) <- silu: memory-bound" in out

    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
    record = json.loads((run_dir / "kernels_auto.json").read_text())
    assert record["diagnosis"] == str(run / "diagnose" / "diagnosis.json")
    assert record["swapped"] == {"rms_norm": 4, "swiglu": 0}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlrun.data.params["kernels.fused"] == "['rms_norm', 'swiglu']"
    assert mlrun.data.tags["kernels.auto"] == "rms_norm, swiglu"
    assert "kernels_auto.json" in [a.path for a in client.list_artifacts(mlrun.info.run_id)]
