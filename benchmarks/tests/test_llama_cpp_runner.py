"""llama.cpp (llama-cpp-python built with GGML_VULKAN=on) behind the edge runner interface, on the
GGUF `python -m src.export --gguf` writes: its perplexity on held-out bytes is torch fp32's with the
same weights, within fp16's rounding for F16 and within each format's own rise for Q8_0 and Q4_0.
Runs on lavapipe (GGML_VK_VISIBLE_DEVICES picks the CPU device llama.cpp skips by default); skips
where llama-cpp-python is not installed, which is the usual case: it builds from source (about 25
minutes on 2 cores), so CI does not install it; benchmarks/notes/2026-12-07-evening.md says how it was built."""
from __future__ import annotations

import os

import pytest

pytest.importorskip("llama_cpp")
pytest.importorskip("gguf")

from omegaconf import OmegaConf  # noqa: E402

from src.config.compose import compose_config  # noqa: E402
from src.export import main as export  # noqa: E402
from tests.support.lavapipe import needs_vulkan  # noqa: E402


@needs_vulkan
def test_llama_cpp_scores_the_exported_model_as_torch_does(tmp_path, monkeypatch):
    from benchmarks.llama_cpp_runner import LlamaCppRunner
    from src.edge.quality import held_out_tokens, perplexity, torch_perplexity
    from src.edge.task import reference_model
    from src.runtime import RunContext
    from src.train.worker import train

    monkeypatch.setenv("GGML_VK_VISIBLE_DEVICES", os.environ.get("GGML_VK_VISIBLE_DEVICES", "0"))
    cfg = compose_config(["model=llama3_tiny", "dist.nproc=1", "precision=fp32", "train.steps=60", "data=text", "data.seq_len=64",
                          "data.batch_size=8", "tracking=none", "train.progress=false", "checkpoint.enabled=true", "optim.lr=3e-3"])
    (tmp_path / "run").mkdir()
    train(cfg, RunContext(run_dir=str(tmp_path / "run"), cwd=str(tmp_path)))
    step = tmp_path / "run" / "checkpoints" / "step_00000060"
    assert export([str(step), "--out", str(tmp_path / "tiny.safetensors")]) == 0
    reference = reference_model(OmegaConf.to_container(cfg.model, resolve=True), {"safetensors": str(tmp_path / "tiny.safetensors")}, 64, 1)
    tokens = held_out_tokens(1, 49, cfg.data.corpus_mb)
    fp32 = torch_perplexity(reference, tokens, 16)
    assert fp32 < 32  # trained: far below the 256 of uniform guessing
    rise = {}
    for fmt in ("f16", "q8_0", "q4_0"):
        out = tmp_path / f"tiny-{fmt}.gguf"
        assert export([str(step), "--gguf", fmt, "--out", str(out)]) == 0
        runner = LlamaCppRunner(out, n_ctx=128)
        assert "llvmpipe" in runner.device()
        rise[fmt] = perplexity(runner, tokens, 16) / fp32 - 1
    assert abs(rise["f16"]) < 1e-3, rise  # fp16 weights and llama.cpp's own arithmetic: 1e-5 measured
    assert abs(rise["q8_0"]) < 0.01 and abs(rise["q4_0"]) < 0.05, rise
