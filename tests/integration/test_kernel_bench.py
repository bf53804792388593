"""task=kernel_bench on the CPU (Triton's interpreter): every op and variant runs, is checked
against eager, and lands in the table, the CSV, the chart, summary.json and MLflow."""
from __future__ import annotations

import csv
import json

import pytest
import torch
from mlflow.tracking import MlflowClient

from src.config.compose import ConfigError, compose_config
from src.config.validate import validate
from tests.support.cli import run_cli

SHAPES = "kernel_bench.shapes={rms_norm:[[33,65]],add_rms_norm:[[9,130]],swiglu:[[17,100]],softmax:[[9,77]],cross_entropy:[[9,300],[3,1000]],linear_cross_entropy:[[40,16,300]]}"
FAST = ["kernel_bench.copy_mb=8", "kernel_bench.rep_ms=5", "kernel_bench.warmup_ms=1"]
# What a machine without a GPU sees: +exp=kernels refused, the table's device "cpu" and no Liger-Kernel
# rows. On a GPU machine +exp=kernels runs for real instead (benchmarks/notes/PERFORMANCE.md's kernel tables).
cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without a GPU sees")


@cpu_only
def test_every_op_and_variant_is_timed_checked_and_logged(tmp_path, mlflow_store):
    mlflow_store(tmp_path)
    proc = run_cli(["task=kernel_bench", SHAPES, "kernel_bench.providers=[eager,triton,liger]", *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
    summary = json.loads((run_dir / "summary.json").read_text())
    rows = summary["rows"]
    ops = ["rms_norm", "add_rms_norm", "swiglu", "softmax", "cross_entropy", "cross_entropy", "linear_cross_entropy"]
    # eager and triton for every op, shape and mode (Liger-Kernel is not installed here)
    assert len(rows) == len(ops) * 2 * 2 and {r["provider"] for r in rows} == {"eager", "triton"}
    for r in rows:
        assert r["ms"] > 0 and r["max_rel_err"] < 0.02, r  # bf16 against eager bf16
        if r["op"] == "linear_cross_entropy":
            assert r["tbs"] is None and r["tflops"] > 0
        else:
            assert r["tbs"] > 0 and r["pct_ceiling"] is None  # no ceiling to hold a CPU's times to
        if r["provider"] == "eager":
            assert r["speedup"] == 1.0
        assert r["graph_ms"] is None and r["chain_ms"] is None and r["chain_tbs"] is None  # GPU timers: none on a CPU
    assert summary["copy_ceiling_tbs"] is None and summary["device"] == "cpu"

    table = (run_dir / "kernel_bench.md").read_text()
    assert "| cross_entropy | 3x1000 | fwd_bwd | triton |" in table and "interpreter" in table
    assert "no copy ceiling off a GPU" in table and "TB/s measured" not in table
    assert "| graph ms | chain ms | host us | TB/s | chain TB/s |" in table
    with open(run_dir / "kernel_bench.csv") as f:
        assert len(list(csv.DictReader(f))) == len(rows)
    assert (run_dir / "kernel_bench.png").stat().st_size > 10_000

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED" and run.data.params["task.name"] == "kernel_bench"
    assert run.data.metrics["summary.swiglu.17x100.fwd_bwd.triton.tbs"] > 0
    assert {"kernel_bench.md", "kernel_bench.csv", "kernel_bench.png", "summary.json"} <= {a.path for a in client.list_artifacts(run.info.run_id)}


def test_torch_compile_is_a_variant(tmp_path):
    proc = run_cli(["task=kernel_bench", "kernel_bench.ops=[swiglu]", "kernel_bench.shapes.swiglu=[[8,64]]", "kernel_bench.modes=[fwd_bwd]",
                    "kernel_bench.providers=[eager,compile]", "tracking=none", *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/summary.json")]
    assert [r["provider"] for r in summary["rows"]] == ["eager", "compile"] and summary["rows"][1]["max_rel_err"] < 0.02


def test_the_backward_alone_is_a_mode_of_its_own(tmp_path):
    """kernel_bench.modes=[bwd]: the backward timed without its forward and charged the backward's bytes
    alone; no row for an op whose fused variants compute the gradient in the forward."""
    from src.fusion.cases import make_case

    proc = run_cli(["task=kernel_bench", "kernel_bench.ops=[rms_norm,cross_entropy]", "kernel_bench.shapes.rms_norm=[[33,65]]",
                    "kernel_bench.shapes.cross_entropy=[[9,300]]", "kernel_bench.modes=[fwd_bwd,bwd]", "kernel_bench.providers=[eager]",
                    "tracking=none", *FAST], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (summary,) = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/summary.json")]
    assert [(r["op"], r["mode"]) for r in summary["rows"]] == [("rms_norm", "fwd_bwd"), ("rms_norm", "bwd"), ("cross_entropy", "fwd_bwd")]
    both, alone = summary["rows"][:2]
    case, size = make_case("rms_norm", [33, 65]), 2  # bf16
    assert alone["tbs"] * 1e12 * alone["ms"] * 1e-3 == pytest.approx(case.bytes_bwd(size))
    assert both["tbs"] * 1e12 * both["ms"] * 1e-3 == pytest.approx(case.bytes_fwd(size) + case.bytes_bwd(size))
    assert "cross_entropy [9, 300] bwd: no row (the fused variants compute the gradient in the forward)" in proc.stderr + proc.stdout


@pytest.mark.parametrize("override,message", [
    ("kernel_bench.ops=[layer_norm]", "kernel_bench.ops=['layer_norm']: unknown layer_norm; choose from rms_norm"),
    ("kernel_bench.providers=[eager,apex]", "kernel_bench.providers=['eager', 'apex']: unknown apex"),
    ("kernel_bench.shapes.linear_cross_entropy=[[8,16]]", "kernel_bench.shapes.linear_cross_entropy=[[8, 16]]: give a list of [tokens, dim, vocab]"),
    ("backend=vulkan", "task=kernel_bench times kernels on backend=cuda"),
])
def test_bad_bench_settings_fail_at_compose_time_with_one_line(override, message):
    with pytest.raises(ConfigError, match=message.replace("[", r"\[").replace("]", r"\]")):
        validate(compose_config(["task=kernel_bench", override]), cuda_device_count=0, mps_available=False)


@cpu_only
def test_exp_kernels_wants_a_gpu(tmp_path):
    proc = run_cli(["+exp=kernels"], cwd=tmp_path)
    # one line that says why and gives a command that does run here
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: backend=cuda but no CUDA GPU is visible; +exp=kernels times kernels on an NVIDIA GPU; "
        "on a CPU, check the plumbing with `TRITON_INTERPRET=1 python -m src.run +exp=kernels_cpu`"]
    assert not (tmp_path / "outputs").exists()


@pytest.mark.parametrize("l2_mb,call_mb,calls", [
    (50, 168, 4),    # RMSNorm 8192x2048 fwd+bwd on an H200: 4 x 168 MB already outgrows 4 x its 50 MB L2
    (50, 1050, 4),   # cross-entropy 8192x32000: never fewer than 4 sets
    (50, 20, 10),    # 10 x 20 MB = 200 MB = 4 L2s
    (50, 1, 32),     # a tiny op: capped at 32 sets
])
def test_a_chain_outgrows_l2_four_times_over_in_4_to_32_calls(l2_mb, call_mb, calls):
    from src.fusion.timing import chain_calls

    assert chain_calls(l2_mb * 2**20, call_mb * 2**20) == calls


