"""Checkpoints on 2 gloo ranks: resume equals an uninterrupted run, a killed rank restarts and
resumes by itself, partial and corrupt checkpoints, resharding 2 -> 1, export, non-finite guards."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from mlflow import MlflowClient
from omegaconf import OmegaConf
from safetensors.torch import load_file

from src.export import main as export_main
from src.models import build_model
from tests.support.cli import read_summary, run_cli

# fp32 so that "equal" means equal: same ranks, same reduction order, same bits.
BASE = ["precision=fp32", "train.steps=10", "checkpoint.enabled=true", "checkpoint.interval=5", "checkpoint.export_safetensors=true", "tracking.system_metrics=false"]


def _run_dir(cwd: Path) -> Path:
    (run_dir,) = [p.parent for p in cwd.glob("outputs/*/*/summary.json")]
    return run_dir


def _losses(run_dir: Path) -> dict[int, float]:
    return {m["step"]: m["loss"] for m in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture(scope="module")
def straight(tmp_path_factory) -> Path:
    """10 steps, undisturbed, checkpoints every 5."""
    cwd = tmp_path_factory.mktemp("straight")
    proc = run_cli([*BASE, f"checkpoint.folder={cwd / 'ck'}", "tracking=none"], cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return cwd


def _assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = load_file(str(a)), load_file(str(b))
    assert wa.keys() == wb.keys()
    for k in wa:
        assert torch.equal(wa[k], wb[k]), k


def test_keep_last_and_only_complete_checkpoints(straight: Path):
    assert sorted(p.name for p in (straight / "ck").iterdir()) == ["step_00000005", "step_00000010"]
    assert (straight / "ck" / "step_00000010" / ".metadata").exists()
    saves = read_summary(straight)["checkpoints"]
    assert [s["step"] for s in saves] == [5, 10] and all(s["total_s"] > 0 for s in saves)


def test_stop_and_resume_equals_an_uninterrupted_run(tmp_path: Path, straight: Path, mlflow_store):
    ck = tmp_path / "ck"
    first = tmp_path / "first"
    first.mkdir()
    assert run_cli([*BASE, "train.steps=5", f"checkpoint.folder={ck}", "tracking=none"], cwd=first).returncode == 0
    second = tmp_path / "second"
    second.mkdir()
    mlflow_store(second)
    proc = run_cli([*BASE, f"checkpoint.folder={ck}"], cwd=second)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(second)
    assert summary["start_step"] == 5 and summary["resumed_from"].endswith("step_00000005")
    resumed, whole = _losses(_run_dir(second)), _losses(_run_dir(straight))
    assert sorted(resumed) == [5, 6, 7, 8, 9]
    assert all(resumed[s] == whole[s] for s in resumed)  # the loss curve carries on exactly
    _assert_same_weights(_run_dir(second) / "model.safetensors", _run_dir(straight) / "model.safetensors")
    run = MlflowClient(f"sqlite:///{second / 'mlflow.db'}").get_run(summary["mlflow_run_id"])
    assert run.data.tags["resumed_at_step"] == "5"


def test_a_killed_rank_restarts_and_resumes_to_the_same_weights(workdir: Path, straight: Path, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli([*BASE, "dist.max_restarts=1", "fault.kind=kill", "fault.rank=1", "fault.step=7", f"checkpoint.folder={workdir / 'ck'}"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = read_summary(workdir)
    assert summary["status"] == "finished" and summary["start_step"] == 5  # the restart resumed from step 5
    _assert_same_weights(_run_dir(workdir) / "model.safetensors", _run_dir(straight) / "model.safetensors")
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.tags["restarts"] == "1"  # one run, continued
    # steps 5 and 6 ran twice (before the kill and after the restart): one record each, everywhere
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == list(range(10))
    assert [json.loads(line)["step"] for line in (_run_dir(workdir) / "metrics.jsonl").read_text().splitlines()] == list(range(10))
    assert _losses(_run_dir(workdir)) == _losses(_run_dir(straight))
    assert "error" not in run.data.tags
    assert (_run_dir(workdir) / "curves.png").exists()


def test_a_run_finished_after_a_restart_keeps_no_error_tag(workdir: Path, mlflow_store):
    """Rank 0 raises, ends the MLflow run FAILED with its error, and the restart finishes it."""
    mlflow_store(workdir)
    proc = run_cli(["precision=fp32", "train.steps=4", "checkpoint.enabled=true", "checkpoint.interval=2", "dist.max_restarts=1",
                    "fault.kind=raise", "fault.rank=0", "fault.step=3", "tracking.system_metrics=false"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    run = client.get_run(read_summary(workdir)["mlflow_run_id"])
    assert run.info.status == "FINISHED" and "error" not in run.data.tags
    assert "injected fault at step 3" in run.data.tags["restart_1.cause"]  # the cause kept, under its own name
    assert sorted(m.step for m in client.get_metric_history(run.info.run_id, "loss")) == [0, 1, 2, 3]


def _error_line(proc) -> str:
    lines = [ln for ln in (proc.stdout + proc.stderr).splitlines() if ln.startswith("error: ")]
    assert len(lines) == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    return lines[0]


def test_a_partial_save_is_skipped_saying_where_the_run_resumes_instead(tmp_path: Path, straight: Path):
    ck = tmp_path / "ck"
    shutil.copytree(straight / "ck", ck)
    partial = ck / "step_00000012.partial"  # a save cut off half-way
    shutil.copytree(ck / "step_00000010", partial)
    (partial / ".metadata").unlink()
    proc = run_cli([*BASE, "train.steps=12", f"checkpoint.folder={ck}", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = proc.stdout + proc.stderr
    assert out.count("step_00000012.partial: a save that did not finish; resuming from step_00000010 instead") == 1  # once, not once per rank
    assert read_summary(tmp_path)["start_step"] == 10
    assert not partial.exists()  # the next save of step 12 replaced it

    proc = run_cli([*BASE, f"checkpoint.resume={partial}"], cwd=tmp_path / "ck")
    assert proc.returncode == 2
    assert f"the newest complete one there is {ck / 'step_00000012'}" in _error_line(proc)


def _refused(args: list[str], cwd: Path) -> str:
    """The run is refused before anything starts: rc 2, one line, no run folder, no MLflow store."""
    cwd.mkdir()
    proc = run_cli(args, cwd=cwd)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert not (cwd / "outputs").exists() and not (cwd / "mlflow.db").exists()
    return _error_line(proc)


def test_a_damaged_checkpoint_is_refused_naming_the_file_before_any_rank_starts(tmp_path: Path, straight: Path):
    ck = tmp_path / "ck"
    shutil.copytree(straight / "ck", ck)
    shard = ck / "step_00000010" / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = bytes(b ^ 0xFF for b in data[len(data) // 2 : len(data) // 2 + 8])  # 8 bytes flipped
    shard.write_bytes(bytes(data))
    line = _refused([*BASE, "train.steps=12", f"checkpoint.folder={ck}"], tmp_path / "flipped")
    assert line == (f"error: checkpoint {ck / 'step_00000010'} is damaged: __1_0.distcp: SHA-256 differs from the manifest's; "
                    f"resume from an earlier one (checkpoint.resume={ck / 'step_00000005'}) or start fresh (checkpoint.resume=none)")
    shard.unlink()
    line = _refused([*BASE, "train.steps=12", f"checkpoint.resume={ck / 'step_00000010'}"], tmp_path / "missing")
    assert "__1_0.distcp: missing" in line
    # resume=auto never falls back past a damaged checkpoint silently; the earlier one loads when named
    proc = run_cli([*BASE, "train.steps=12", f"checkpoint.resume={ck / 'step_00000005'}", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 0 and read_summary(tmp_path)["start_step"] == 5


def test_a_checkpoint_of_another_model_is_refused_before_any_rank_starts(tmp_path: Path, straight: Path):
    line = _refused([*BASE, "model.dim=96", f"checkpoint.resume={straight / 'ck' / 'step_00000010'}"], tmp_path / "wider")
    assert "was saved from another model: embed.weight is [256, 64] there, [256, 96] in model tiny" in line
    assert "(saved with model.name=tiny, model.dim=64, model.n_layers=2" in line
    line = _refused([*BASE, "model.n_layers=3", f"checkpoint.resume={straight / 'ck' / 'step_00000010'}"], tmp_path / "deeper")
    assert "model tiny has layers.2." in line and "the checkpoint lacks it" in line


@pytest.fixture
def small_disk(tmp_path: Path):
    """A real filesystem that fills: a tmpfs of a given size (root only: CI runs as root)."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mounts = []

    def mount(size: str, *options: str) -> Path:
        folder = tmp_path / f"disk{len(mounts)}"
        folder.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", ",".join([f"size={size}", *options]), "tmpfs", str(folder)], check=True)
        mounts.append(folder)
        return folder

    yield mount
    for folder in mounts:
        subprocess.run(["umount", str(folder)], check=False)


def test_a_disk_that_fills_mid_save_is_one_line_and_keeps_the_previous_checkpoint(tmp_path: Path, small_disk):
    disk = small_disk("2600k")  # one checkpoint of model tiny (1.8 MB) fits, a second does not
    proc = run_cli([*BASE, f"checkpoint.folder={disk}", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 1, proc.stdout + proc.stderr
    line = _error_line(proc)
    assert f"checkpoint step_00000010: no space left in {disk}: a checkpoint needs about" in line and "step_00000005 is kept" in line
    assert sorted(p.name for p in disk.iterdir()) == ["step_00000005"]  # no partial left to trip a resume
    from src.train.checkpoint import verify_checkpoint

    assert verify_checkpoint(disk / "step_00000005") is not None  # whole, and it says so


def test_a_checkpoint_folder_without_room_or_write_access_is_refused_before_any_rank_starts(tmp_path: Path, small_disk):
    full = small_disk("600k")
    line = _refused([*BASE, f"checkpoint.folder={full / 'ck'}"], tmp_path / "full")
    assert f"checkpoint.folder={full / 'ck'}: a checkpoint of model tiny takes about" in line and f"{full} has" in line
    read_only = small_disk("10m", "ro")
    line = _refused([*BASE, f"checkpoint.folder={read_only / 'ck'}"], tmp_path / "ro")
    assert line == (f"error: checkpoint.folder={read_only / 'ck'}: cannot write in {read_only} (Read-only file system); "
                    "set checkpoint.folder to a writable folder")


def test_two_rank_checkpoint_loads_in_one_process_and_exports_for_inference(tmp_path: Path, straight: Path, capsys):
    ckpt = straight / "ck" / "step_00000010"
    out = tmp_path / "exported.safetensors"
    assert export_main([str(ckpt), "--out", str(out)]) == 0
    # resharded 2 -> 1 by DCP, the same weights the 2 ranks gathered themselves at the end
    _assert_same_weights(out, _run_dir(straight) / "model.safetensors")
    umask = os.umask(0)
    os.umask(umask)
    for weights in (out, _run_dir(straight) / "model.safetensors"):  # safetensors alone leaves 0600
        assert weights.stat().st_mode & 0o777 == 0o666 & ~umask, oct(weights.stat().st_mode)
    cfg = OmegaConf.load(ckpt / "config.yaml")  # the model's shape, as build_model reads it
    model = build_model(cfg)
    model.load_state_dict(load_file(str(out)))
    tokens = torch.randint(0, cfg.vocab_size, (2, 17))
    reference = build_model(cfg)
    reference.load_state_dict(load_file(str(_run_dir(straight) / "model.safetensors")))
    torch.testing.assert_close(model(tokens), reference(tokens), rtol=0, atol=0)


def test_a_nan_loss_fails_the_run_with_its_step_and_saves_no_nan_checkpoint(workdir: Path, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli([*BASE, "checkpoint.interval=2", "fault.kind=nan", "fault.rank=0", "fault.step=3", f"checkpoint.folder={workdir / 'ck'}"], cwd=workdir)
    assert proc.returncode == 1
    assert "non-finite loss nan" in proc.stderr and "at step 3" in proc.stderr
    assert sorted(p.name for p in (workdir / "ck").iterdir()) == ["step_00000002"]  # step 4's was never written
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and "at step 3" in run.data.tags["error"]
    assert "killed by signal" not in run.data.tags["error"]  # the cause, never a peer's abort (once seen under load)


def test_nonfinite_skip_drops_the_step_warns_and_counts_it(workdir: Path, mlflow_store):
    mlflow_store(workdir)
    proc = run_cli([*BASE, "train.nonfinite=skip", "fault.kind=nan", "fault.rank=0", "fault.step=3"], cwd=workdir)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    weights = load_file(str(_run_dir(workdir) / "model.safetensors"))
    assert all(torch.isfinite(w).all() for w in weights.values())
    out = proc.stdout + proc.stderr
    assert out.count("step 3: non-finite loss or gradient norm; its optimizer update is skipped (train.nonfinite=skip)") == 1
    summary = read_summary(workdir)
    assert summary["skipped_steps"] == 1 and summary["skipped_at"] == [3]
    client = MlflowClient(f"sqlite:///{workdir / 'mlflow.db'}")
    assert client.get_run(summary["mlflow_run_id"]).data.metrics["summary.skipped_steps"] == 1


def test_async_saves_overlap_training_and_resume_the_same(tmp_path: Path, straight: Path):
    proc = run_cli([*BASE, "checkpoint.async_mode=true", f"checkpoint.folder={tmp_path / 'ck'}", "tracking=none"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    saves = read_summary(tmp_path)["checkpoints"]
    assert [s["step"] for s in saves] == [5, 10] and all(s["size_mb"] > 0 and s["total_s"] >= s["blocking_s"] for s in saves)
    assert sorted(p.name for p in (tmp_path / "ck").iterdir()) == ["step_00000005", "step_00000010"]
    _assert_same_weights(_run_dir(tmp_path) / "model.safetensors", _run_dir(straight) / "model.safetensors")
    out = tmp_path / "from_async.safetensors"  # what the background thread wrote is a whole checkpoint
    assert export_main([str(tmp_path / "ck" / "step_00000010"), "--out", str(out)]) == 0
    _assert_same_weights(out, _run_dir(straight) / "model.safetensors")


def _resume_step_10(straight: Path, cwd: Path, args: list[str]) -> dict:
    """Step 10 of `straight`'s run, resumed from its last checkpoint with `args`: the summary."""
    cwd.mkdir()
    proc = run_cli([*BASE, "train.steps=11", "tracking=none", "checkpoint.enabled=false", "checkpoint.export_safetensors=false",
                    f"checkpoint.resume={straight / 'ck' / 'step_00000010'}", *args], cwd=cwd)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return read_summary(cwd)


@pytest.fixture(scope="module")
def resumed_on_two(straight: Path, tmp_path_factory) -> dict:
    """The reference for the resharded resumes: step 10 on the 2 ranks that saved it, run once for both."""
    return _resume_step_10(straight, tmp_path_factory.mktemp("resumed") / "same", [])


@pytest.mark.parametrize("nproc,batch", [(1, 16), (4, 4)])
def test_a_two_rank_checkpoint_resumes_on_one_or_four_ranks(tmp_path: Path, straight: Path, resumed_on_two: dict, nproc: int, batch: int):
    """The same global batch (2 x 8 = 1 x 16 = 4 x 4 sequences), so step 10 sees the same data and,
    from the same weights, gives the same loss: DCP resharded weights and AdamW state."""
    resharded = _resume_step_10(straight, tmp_path / "resharded", [f"dist.nproc={nproc}", f"data.batch_size={batch}"])
    assert resharded["start_step"] == 10 and resharded["settings"]["world_size"] == nproc
    # only the order of the loss reduction over ranks differs
    assert resharded["final_loss"] == pytest.approx(resumed_on_two["final_loss"], rel=1e-6)
