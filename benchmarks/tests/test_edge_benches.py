"""The edge benches on this machine's real parts: IREE to Vulkan on Mesa's lavapipe standing in for
a GPU's driver, torch on the CPU standing in for torch CUDA."""
from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

pytest.importorskip("iree.turbine")

from src.edge.compile import build  # noqa: E402
from src.edge.task import reference_model  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402
from tests.support.lavapipe import needs_vulkan  # noqa: E402

TINY = {"name": "tiny", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_mult": 4, "causal": True,
        "norm_eps": 1e-6, "init_std": 0.02, "mlp": "silu", "ffn_hidden": 0}
PROMPT, STEPS = 8, 10


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("edge_cache")


@needs_vulkan
def test_the_round_trip_probe_calls_decode_async_and_agrees_with_the_sync_call(tmp_path, cache):
    ref = reference_model(TINY, {"seed": 0}, PROMPT + STEPS, 1)
    art = build(ref, TINY, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "art", cache, {"seed": 0}, params=False)
    proc = run_cli(["--module", str(art.dir), "--steps", "4", "--json", str(tmp_path / "probe.json")], cwd=tmp_path, module="benchmarks.edge_roundtrip")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # a row per entry point: decode with its logits, decode_token without (its results' alloca
    # 4 bytes where decode's holds the (1, 256) fp32 logits too, 64-byte aligned)
    rows = json.loads((tmp_path / "probe.json").read_text())
    assert [r["function"] for r in rows] == ["decode", "decode_token"], rows
    for row, results in zip(rows, (1088, 4)):
        assert row["tokens_agree"] is True and row["queue_ops"] == {"alloca": 2, "dealloca": 1, "execute.indirect": 1}, row
        assert row["alloca_bytes"][0] == results, row
        assert all(row[k] > 0 for k in ("sync_ms", "async_wait_ms", "async_poll_ms", "invoke_ms", "enqueue_ms", "pipelined_ms_per_step",
                                        "read_wait_ms", "read_poll_ms"))
    # the same module's decode, each dispatch timed by the device (IREE's HAL profiling)
    proc = run_cli(["--module", str(art.dir), "--calls", "3", "--json", str(tmp_path / "dispatches.json")], cwd=tmp_path, module="benchmarks.edge_dispatches")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "dispatches.json").read_text())[art.dir.name]
    assert rows and all(r["us_per_call"] > 0 and r["per_call"] >= 1 for r in rows), rows
    assert any("matmul" in r["dispatch"] for r in rows) and rows == sorted(rows, key=lambda r: -r["us_per_call"])
    assert "GPU time per decode call" in proc.stdout
    # and its prefill's: the prompt's products (PROMPT rows) among them
    proc = run_cli(["--module", str(art.dir), "--calls", "2", "--function", "prefill", "--json", str(tmp_path / "prefill.json")], cwd=tmp_path,
                   module="benchmarks.edge_dispatches")
    assert proc.returncode == 0 and "GPU time per prefill call" in proc.stdout, proc.stdout + proc.stderr
    rows = json.loads((tmp_path / "prefill.json").read_text())[art.dir.name]
    assert any(re.search(rf"matmul_1x{PROMPT}x", r["dispatch"]) for r in rows), rows


@needs_vulkan
def test_the_gpu_campaign_compiles_and_runs_side_by_side_on_lavapipe(tmp_path, cache):
    """`python -m benchmarks.edge_vs_torch` end to end, with llvmpipe modules and torch on the CPU
    standing in for the NVIDIA ones and torch CUDA: the code path the device call takes."""
    art, out = tmp_path / "art", tmp_path / "out"
    small = json.dumps({"vocab_size": 256, "dim": 64})
    proc = run_cli(["compile", "--out", str(art), "--models", "tiny", "--target", "llvmpipe", "--quick", "--model-overrides", small,
                    "--cache-dir", str(cache)], cwd=tmp_path, module="benchmarks.edge_vs_torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert sorted(p.name for p in art.iterdir() if p.is_dir()) == ["tiny-fp16-b2-llvmpipe-nocoop", "tiny-fp32-b1-llvmpipe-nocoop"]
    # fp16 at batch 2 does not compile without growing hoists for llvmpipe in IREE 3.13: the fallback
    # to IREE's default hoisting is taken and recorded
    hoisting = {p.name: json.loads((p / "manifest.json").read_text())["hoisting"] for p in art.iterdir() if p.is_dir()}
    assert hoisting["tiny-fp32-b1-llvmpipe-nocoop"] == "no growing hoists", hoisting
    assert hoisting["tiny-fp16-b2-llvmpipe-nocoop"].startswith("IREE's default (without growing hoists: "), hoisting
    assert not list(art.rglob("*.irpa"))  # parameters are written on the device, only code travels
    proc = run_cli(["run", "--artifacts", str(art), "--out", str(out), "--torch", "cpu", "--repeats", "2", "--warmup", "1",
                    "--runtime-flags=--vulkan_tracing=false"],
                   cwd=tmp_path, module="benchmarks.edge_vs_torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    lines = (out / "table.md").read_text().splitlines()
    assert lines[0] == ("| backend | device | model | dtype | quant | batch | prompt | variant | TTFT p50 ms | decode p50 ms | call ms | read ms "
                        "| prefill tok/s | decode tok/s | floor share | max rel err | same tokens | status |")
    results = json.loads((out / "results.json").read_text())
    assert sorted((r["backend"], r["dtype"], r["batch"]) for r in results) == [("cpu", "fp16", 2), ("cpu", "fp32", 1), ("vulkan", "fp16", 2), ("vulkan", "fp32", 1)]
    assert all(r["status"] == "finished" and r["decode_p50_ms"] > 0 and r["greedy_mismatches"] == 0 for r in results), results
    # the step split in two, and the runtime flags the Vulkan rows ran under, in their variant's name
    assert all(r["decode_call_ms"] > 0 and r["token_read_ms"] > 0 for r in results)
    assert sorted(r["variant"] for r in results if r["backend"] == "vulkan") == ["llvmpipe-nocoop+vulkan_tracing=false"] * 2
    assert "Vulkan / torch eager decode p50" in (out / "table.md").read_text()
