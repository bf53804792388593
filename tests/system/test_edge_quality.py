"""Edge quality as perplexity on held-out text (src/edge/quality.py), through the module as
deployed: teacher-forced prefill and decode calls give the full forward's perplexity; a model
trained here on text, exported and quantized to int8, is scored through its IREE module on Mesa's
lavapipe against torch fp32 with the same weights."""
from __future__ import annotations

import json
import math
import sysconfig
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("iree.turbine")

from src.data.batches import stdlib_corpus  # noqa: E402
from src.edge.quality import held_out_bytes, held_out_tokens, perplexity, torch_perplexity  # noqa: E402
from src.edge.runtime import TorchRunner  # noqa: E402
from src.edge.task import reference_model  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402
from tests.support.lavapipe import needs_vulkan  # noqa: E402

TINY = {"name": "tiny", "arch": "mini_llm", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_mult": 4, "causal": True,
        "norm_eps": 1e-6, "init_std": 0.02, "mlp": "silu", "ffn_hidden": 0}


def test_held_out_text_starts_where_the_training_corpus_ends():
    sources = b"".join(p.read_bytes() for p in sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))
    corpus = stdlib_corpus(0.2)
    assert sources.startswith(corpus) and held_out_bytes(0.2, 5000) == sources[len(corpus): len(corpus) + 5000]
    tokens = held_out_tokens(3, 40, 0.2)
    assert tokens.shape == (3, 40) and tokens.dtype == np.int32 and bytes(tokens.astype(np.uint8).ravel()) == sources[len(corpus): len(corpus) + 120]


def test_teacher_forced_calls_give_the_full_forwards_perplexity():
    """Prefill, then decode fed each true token, scores tokens[:, P:] as one forward over the whole
    sequence does (its cross-entropy from position P - 1 on)."""
    prompt, length = 6, 20
    lm = reference_model(TINY, {"seed": 3}, max_seq=length, batch=2)
    tokens = held_out_tokens(2, length, 4.0)
    with torch.no_grad():
        logits = lm.model(torch.from_numpy(tokens).long())  # (B, T, V)
    want = math.exp(F.cross_entropy(logits[:, prompt - 1:-1].reshape(-1, 256), torch.from_numpy(tokens[:, prompt:]).long().reshape(-1)).item())
    assert torch_perplexity(lm, tokens, prompt) == pytest.approx(want, rel=1e-5)
    runner = TorchRunner(reference_model(TINY, {"seed": 3}, max_seq=length, batch=2), "cpu", "fp32", 2)
    assert perplexity(runner, tokens, prompt) == pytest.approx(want, rel=1e-5)


@needs_vulkan
def test_a_trained_models_int8_module_on_lavapipe_scores_within_one_percent_of_fp32(tmp_path):
    """model=tiny trained on the standard library's text, exported, its blocks' weights int8 in an
    IREE module on lavapipe: perplexity far below the uniform 256, the module's equal to torch's with
    the same int8 weights (it computes what was quantized), and within 1% of fp32's."""
    proc = run_cli(["model=tiny", "train.steps=150", "data.seq_len=128", "data.batch_size=8", "optim.lr=3e-3", "dist.nproc=1",
                    "tracking=none", "checkpoint.enabled=true", f"hydra.run.dir={tmp_path / 'train'}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (step,) = (tmp_path / "train" / "checkpoints").glob("step_*")
    export = run_cli([str(step), "--out", str(tmp_path / "tiny.safetensors")], cwd=tmp_path, module="src.export")
    assert export.returncode == 0, export.stderr
    proc = run_cli(["+exp=edge", "model=tiny", f"edge.weights={tmp_path / 'tiny.safetensors'}", "edge.quant=int8", "edge.prompt_len=32",
                    "edge.decode_steps=31", "edge.batch=2", "edge.repeats=1", "edge.warmup=0", f"edge.cache_dir={tmp_path / 'cache'}",
                    "tracking=none", f"hydra.run.dir={tmp_path / 'edge'}"], cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    s = json.loads((tmp_path / "edge" / "summary.json").read_text())
    assert s["quant"] == "int8" and s["perplexity_tokens"] == 2 * 32 and s["uniform_perplexity"] == 256
    assert s["perplexity_fp32"] < 0.25 * 256, s["perplexity_fp32"]  # trained: far below uniform
    assert s["perplexity"] == pytest.approx(s["perplexity_quantized_torch"], rel=1e-3)
    assert abs(s["perplexity_increase"]) < 0.01
    assert "perplexity (fp32)" in proc.stdout + proc.stderr
