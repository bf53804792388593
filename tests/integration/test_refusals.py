"""The helper commands, and `python -m src.run`, refuse what is not theirs in one line that names
it (exit 2, no traceback): for src.run before any rank, run folder or MLflow run exists."""
from __future__ import annotations

import gzip
import os
import re
import shutil
from pathlib import Path

import pytest

import src.config.compose
from src.config.compose import CONF_DIR, ConfigError, compose_config
from src.config.validate import validate
from src.diagnose import main as diagnose_main
from src.export import main as export_main
from src.run import preflight
from tests.support.cli import run_cli

EXPS = sorted(p.stem for p in (CONF_DIR / "exp").glob("*.yaml"))
H200 = (141_000_000_000, "an NVIDIA H200 has 141.0 GB")  # the GPU presets' target (docs/RESULTS.md)
# a model small enough to train a step in a second or two on one CPU rank
QUICK = ["model=tiny", "dist.nproc=1", "train.steps=1", "data.batch_size=1", "data.seq_len=16", "train.progress=false"]


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_diagnose_says_random_bytes_are_not_an_nsight_compute_report(tmp_path: Path, capsys):
    noise = os.urandom(4096)
    (tmp_path / "x.ncu-rep").write_bytes(noise)
    assert diagnose_main([str(tmp_path / "x.ncu-rep"), "--out", str(tmp_path / "out")]) == 2
    assert "x.ncu-rep: not an Nsight Compute report (no NVR header)" in _error_line(capsys)
    (tmp_path / "y.ncu-rep.gz").write_bytes(noise)  # not gzip at all
    assert diagnose_main([str(tmp_path / "y.ncu-rep.gz"), "--out", str(tmp_path / "out")]) == 2
    assert "y.ncu-rep.gz: not an Nsight Compute report (not gzip data" in _error_line(capsys)
    (tmp_path / "z.ncu-rep.gz").write_bytes(gzip.compress(noise))  # gzip of something else
    assert diagnose_main([str(tmp_path / "z.ncu-rep.gz"), "--out", str(tmp_path / "out")]) == 2
    assert "not an Nsight Compute report" in _error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_export_says_there_is_no_checkpoint_there(tmp_path: Path, capsys):
    assert export_main([str(tmp_path / "MISSING_DIR"), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "MISSING_DIR: no checkpoint there (no such folder)" in _error_line(capsys)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / ".metadata").write_bytes(b"")
    assert export_main([str(run / "checkpoints"), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "no checkpoint there (no DCP .metadata); the newest inside is" in _error_line(capsys)
    assert not (tmp_path / "m.safetensors").exists()


def _refused(workdir: Path, args: list[str]) -> str:
    """`python -m src.run ARGS` in `workdir`: exit 2, one `error:` line on stderr, nothing left
    behind (no outputs/ or multirun/, no mlflow.db: no MLflow run). Returns the line."""
    proc = run_cli(args, cwd=workdir, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and len(lines) == 1 and lines[0].startswith("error: "), (proc.returncode, proc.stderr)
    assert list(workdir.iterdir()) == [], list(workdir.iterdir())
    return lines[0]


def _config_dir(tmp_path: Path, files: dict[str, str]) -> Path:
    folder = tmp_path / "extra_conf"
    for name, text in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_text(text)
    return folder


def test_a_yaml_syntax_error_in_a_config_dir_file_names_the_file_and_line(tmp_path: Path):
    extra = _config_dir(tmp_path, {"model/bad.yaml": "defaults: [/base_model_mini_llm@_here_, _self_]\nname: bad\ndim: [32\nn_layers: 1\n"})
    workdir = tmp_path / "work"
    workdir.mkdir()
    assert _refused(workdir, ["--config-dir", str(extra), "model=bad"]) == (
        f"error: {extra}/model/bad.yaml, line 4, column 9: not valid YAML: expected ',' or ']', but got ':' "
        "(while parsing a flow sequence that starts on line 3); fix that line")


def test_a_yaml_syntax_error_in_the_projects_conf_names_the_file_and_line(tmp_path: Path, monkeypatch):
    conf = tmp_path / "conf"
    shutil.copytree(CONF_DIR, conf)
    tiny = conf / "model" / "tiny.yaml"
    tiny.write_text(tiny.read_text().replace("dim: 64", "dim: 64\n\tn_heads: 4"))  # a tab cannot start a YAML token
    monkeypatch.setattr(src.config.compose, "CONF_DIR", conf)
    with pytest.raises(ConfigError) as err:
        preflight(["model=tiny"], multirun=False)
    assert str(err.value) == f"{tiny}, line 6, column 1: not valid YAML: found character '\\t' that cannot start any token; fix that line"


def test_a_malformed_rendezvous_endpoint_is_refused_on_the_command_line(workdir: Path):
    assert _refused(workdir, ["dist.rdzv_endpoint=localhost:99999"]) == (
        "error: dist.rdzv_endpoint=localhost:99999: the port must be a number from 1 to 65535, not '99999'; "
        "use HOST:PORT, e.g. dist.rdzv_endpoint=node0:29400 (the first node's address)")


@pytest.mark.parametrize("overrides,message", [
    (["dist.rdzv_endpoint=localhost:"], "dist.rdzv_endpoint=localhost:: the port must be a number from 1 to 65535, not ''"),
    (["dist.rdzv_endpoint=node0:http"], "dist.rdzv_endpoint=node0:http: the port must be a number from 1 to 65535, not 'http'"),
    (["dist.rdzv_endpoint=http://node0:29400"], "dist.rdzv_endpoint=http://node0:29400: 'http://node0' is not a host name or IP address; "
                                                "use HOST:PORT with no scheme or path"),
    (["dist.rdzv_endpoint='node 0:29400'"], "dist.rdzv_endpoint=node 0:29400: 'node 0' is not a host name or IP address"),
    (["dist.rdzv_endpoint=node0:0", "dist.nnodes=2"], "dist.rdzv_endpoint=node0:0: port 0 lets the first node bind any free port, "
                                                      "which the other 1 node(s) cannot know; name a free port"),
])
def test_malformed_rendezvous_endpoints_are_refused(overrides, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        preflight(overrides, multirun=False)


@pytest.mark.parametrize("endpoint", ["node0:29400", "10.0.0.1:29400", "[::1]:29400", "node0", "localhost:0"])
def test_well_formed_rendezvous_endpoints_pass(endpoint):
    validate(compose_config([f"dist.rdzv_endpoint='{endpoint}'"]), cuda_device_count=0, mps_available=False)  # quoted: Hydra's grammar reads [ as a list


def test_an_empty_run_dir_is_refused(workdir: Path):
    assert _refused(workdir, ["hydra.run.dir="]) == (
        f"error: hydra.run.dir=: an empty folder puts the run's files (config.yaml, summary.json, run.log, .hydra/) straight into "
        f"{workdir}; give them a folder of their own, e.g. hydra.run.dir=outputs/mine")


def test_an_empty_sweep_dir_is_refused(workdir: Path):
    assert _refused(workdir, ["-m", "train.steps=1,2", "hydra.sweep.dir="]) == (
        f"error: hydra.sweep.dir=: an empty folder puts the sweep's files (multirun.yaml, a folder per job: 0/, 1/, ...) straight "
        f"into {workdir}; give them a folder of their own, e.g. hydra.sweep.dir=multirun/mine")


def test_the_current_folder_as_run_dir_is_refused(tmp_path: Path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=re.escape("hydra.run.dir=./: naming the current folder puts the run's files")):
        preflight(["hydra.run.dir=./"], multirun=False)


def test_a_config_dir_adds_its_options_to_the_run(tmp_path: Path):
    extra = _config_dir(tmp_path, {"model/mine.yaml": "defaults: [/base_model_mini_llm@_here_, _self_]\nname: mine\nvocab_size: 256\n"
                                                       "dim: 32\nn_layers: 1\nn_heads: 2\n"})
    workdir = tmp_path / "work"
    workdir.mkdir()
    proc = run_cli(["-cd", str(extra), *QUICK, "model=mine", "tracking=none"], cwd=workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr
    (config,) = workdir.glob("outputs/*/*/config.yaml")
    assert "name: mine" in config.read_text() and "dim: 32" in config.read_text()


def test_a_missing_config_dir_is_refused(tmp_path: Path):
    workdir = tmp_path / "work"
    workdir.mkdir()
    assert _refused(workdir, ["--config-dir", str(tmp_path / "nowhere"), "model=tiny"]) == (
        f"error: --config-dir {tmp_path / 'nowhere'}: no such folder; give a folder of extra config files, "
        "e.g. DIR/model/mine.yaml for model=mine")


def test_a_non_ascii_run_name_lands_in_mlflow(workdir: Path, mlflow_store):
    from mlflow.tracking import MlflowClient

    mlflow_store(workdir)
    proc = run_cli([*QUICK, "tracking.run_name=expérience", "tracking.system_metrics=false"], cwd=workdir, timeout=300)
    assert proc.returncode == 0, proc.stderr
    client = MlflowClient(tracking_uri=f"sqlite:///{workdir / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert [(r.info.run_name, r.info.status) for r in runs] == [("expérience", "FINISHED")]


def test_an_edge_target_the_installed_iree_compiler_does_not_know_is_refused(workdir: Path):
    pytest.importorskip("iree.compiler")
    from src.edge.iree_targets import compiler_version, known_names, resolves

    assert resolves("llvmpipe") is True and resolves("gfx9999") is False
    # gfx9999 passes src/edge/targets.py's gfxNNNN pattern: the compiler alone says it has no such target
    assert _refused(workdir, ["+exp=edge", "model=tiny", "edge.action=compile", "edge.target=gfx9999"]) == (
        f"error: edge.target=gfx9999: the installed IREE compiler ({compiler_version()}) knows no Vulkan target of that name "
        f"and would crash compiling for it; use one it knows: {', '.join(known_names())}")
    assert "llvmpipe" in known_names()


def test_a_model_that_cannot_fit_is_refused_before_any_rank(workdir: Path):
    line = _refused(workdir, ["model=tiny", "model.dim=65536", "model.n_layers=64"])
    assert re.fullmatch(
        r"error: the run needs about 66\.4 TB: 2 ranks x 33\.2 TB a rank \(parameters 6\.6 TB, gradients 6\.6 TB, AdamW state 13\.2 TB, "
        r"AdamW's foreach buffer 6\.6 TB, working copies 206\.2 GB, activations 146\.0 GB; 3\.30T parameters over 2 rank\(s\)\), "
        r"and this host has [\d.]+ [GMT]B available; "
        r"use a narrower model \(model\.n_layers=1 does not fit at model\.dim=65536\), more hosts \(dist\.nnodes; this host's ranks "
        r"share its memory\), ac\.mode=full or a data\.batch_size below 8", line), line


def test_a_gpu_run_is_held_to_the_gpus_memory():
    h200 = {"cuda_device_count": 1, "mps_available": False, "cuda_capability": ((9, 0), "NVIDIA H200"), "memory": H200}
    validate(compose_config(["model=llama3_8b", "backend=cuda", "dist.nproc=1", "data=random"]), **h200)  # 8B parameters: 131.5 GB
    with pytest.raises(ConfigError) as err:
        validate(compose_config(["model=llama3_8b", "backend=cuda", "dist.nproc=1", "data=random", "model.n_layers=40"]), **h200)
    assert str(err.value) == (
        "the run needs about 159.4 GB a rank (parameters 39.1 GB, gradients 39.1 GB, AdamW state 78.2 GB, working copies 3.0 GB, "
        "activations 9.1 GB; 9.78B parameters over 1 rank(s)), and an NVIDIA H200 has 141.0 GB; use model.n_layers=34, "
        "more GPUs (dist.nproc, dist.nnodes), ac.mode=full or a data.batch_size below 8")


@pytest.mark.parametrize("exp", EXPS)
def test_every_preset_fits_its_machine(exp):
    """The CPU presets on this 2-core, 24 GiB machine with room to spare; the GPU ones on an H200."""
    from src.memory_estimate import estimate

    cfg = compose_config([f"+exp={exp}"])
    if cfg.task.name not in ("train", "profile", "diagnose"):
        return  # kernel_bench and infer train nothing: no estimate
    ranks = 1 if cfg.backend.name == "cuda" else cfg.dist.nproc
    budget = H200[0] if cfg.backend.name == "cuda" else 24 * 2**30
    assert estimate(cfg).peak * ranks < budget / 2
    if cfg.backend.name == "cuda":
        validate(cfg, cuda_device_count=cfg.dist.nproc, mps_available=False, cuda_capability=((9, 0), "NVIDIA H200"), memory=H200)
    else:
        validate(cfg, cuda_device_count=0, mps_available=False)


def test_more_cpu_ranks_than_cores_warn_in_one_line_and_run(capsys):
    cores = len(os.sched_getaffinity(0))
    preflight([f"dist.nproc={cores + 62}"], multirun=False)
    err = capsys.readouterr().err
    assert err == (f"warning: dist.nproc={cores + 62} CPU ranks on {cores} core(s): the ranks share the cores and the run will be slow; "
                   f"dist.nproc={cores} or fewer uses each core once\n")
    preflight([f"dist.nproc={cores}"], multirun=False)
    assert capsys.readouterr().err == ""


def test_a_visible_gpus_memory_is_read_from_torch(monkeypatch):
    """No GPU here: torch.cuda answers as a machine with two 80 GB GPUs would (the smaller one counts)."""
    import torch

    class Props:
        def __init__(self, i: int):
            self.total_memory, self.name = (80_000_000_000, 85_000_000_000)[i], f"GPU{i}"

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    monkeypatch.setattr(torch.cuda, "get_device_properties", Props)
    gpus = {"cuda_device_count": 2, "mps_available": False, "cuda_capability": ((9, 0), "GPU0")}
    validate(compose_config(["model=llama3_1b", "backend=cuda", "dist.nproc=2", "data=random"]), **gpus)
    with pytest.raises(ConfigError, match=r"and the GPU \(GPU0\) has 80\.0 GB; use model\.n_layers=\d+, more GPUs"):
        validate(compose_config(["model=llama3_8b", "backend=cuda", "dist.nproc=1", "data=random"]), **gpus)


def _closed_port() -> int:
    import socket

    with socket.socket() as s:  # a port of this machine that nothing listens on once closed
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("uri, line", [
    ("sqlite:///afolder", "tracking.uri=sqlite:///afolder: {cwd}/afolder is a folder, not a database file; name a file in it, "
                          "e.g. sqlite:///{cwd}/afolder/mlflow.db; or track here: tracking.uri=sqlite:///mlflow.db"),
    ("postgresql://me:secret@127.0.0.1:{port}/runs", "tracking.uri=postgresql://me:***@127.0.0.1:{port}/runs: the postgresql server at "
                                                     "127.0.0.1:{port} does not accept a connection (Connection refused within 3 s)"),
    ("http://127.0.0.1:99999", "tracking.uri=http://127.0.0.1:99999: port 99999 is not a port (1-65535)"),
])
def test_a_tracking_store_that_cannot_be_opened_is_refused_in_seconds(uri: str, line: str, tmp_path: Path, monkeypatch):
    """MLflow's client retries such a store for minutes and names neither the URI nor the setting;
    preflight opens it for a moment, and the password never reaches the line."""
    import time

    monkeypatch.chdir(tmp_path)
    (tmp_path / "afolder").mkdir()
    port = _closed_port()
    start = time.monotonic()
    with pytest.raises(ConfigError) as err:
        preflight([f"tracking.uri={uri.format(port=port)}"], multirun=False)
    assert time.monotonic() - start < 15
    assert line.format(cwd=tmp_path, port=port) in str(err.value) and "\n" not in str(err.value) and "secret" not in str(err.value)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afolder"]  # no store, no run folder


def test_export_names_an_out_it_cannot_write_before_reading_the_checkpoint(tmp_path: Path, capsys):
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"")  # never read: the refusal comes first
    (ckpt / "config.yaml").write_text("name: tiny\narch: mini_llm\nvocab_size: 256\ndim: 64\nn_layers: 2\nn_heads: 4\n")
    (tmp_path / "file").write_text("")
    assert export_main([str(ckpt), "--out", str(tmp_path / "file" / "model.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: --out {tmp_path / 'file' / 'model.safetensors'}: cannot write there") and len(err.strip().splitlines()) == 1
    (tmp_path / "adir").mkdir()
    assert export_main([str(ckpt), "--out", str(tmp_path / "adir")]) == 2
    assert "a folder; name the file" in capsys.readouterr().err


def test_a_rotary_base_of_zero_is_refused_before_any_rank():
    with pytest.raises(ConfigError, match=r"model.rope_theta=0.0: the rotary embedding's base must be above 0"):
        validate(compose_config(["model=llama3_tiny", "model.rope_theta=0"]), cuda_device_count=0, mps_available=False)


def test_a_binary_file_given_as_text_is_said_once(tmp_path: Path, capsys):
    binary = tmp_path / "blob"
    binary.write_bytes(bytes(range(256)) * 64)
    for _ in range(2):
        validate(compose_config([f"data.text_path={binary}"]), cuda_device_count=0, mps_available=False)
    err = capsys.readouterr().err
    assert err.count(f"warning: data.text_path={binary} holds NUL bytes: a binary file, not text") == 1, err


def test_a_path_that_is_not_utf8_is_refused_before_anything_starts(tmp_path: Path):
    import subprocess
    import sys

    from tests.support.cli import REPO

    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run([sys.executable, "-m", "src.run", b"data.text_path=" + bytes(tmp_path) + b"/caf\xe9.txt"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith(f"error: data.text_path={tmp_path}/caf\\xe9.txt: byte 0xe9 is not UTF-8") and len(proc.stderr.strip().splitlines()) == 1
    assert list(tmp_path.iterdir()) == []


def test_export_names_a_cut_off_config_yaml(tmp_path: Path, capsys):
    ckpt = tmp_path / "step_00000002"
    ckpt.mkdir()
    (ckpt / ".metadata").write_bytes(b"")
    (ckpt / "config.yaml").write_text("name: tiny\narch: [")
    assert export_main([str(ckpt), "--out", str(tmp_path / "m.safetensors")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"error: {ckpt / 'config.yaml'}: cut off or not YAML") and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "m.safetensors").exists()
