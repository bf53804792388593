"""Batch above one and a long prefill on the edge path (issue 57): the batch-4 decode module and the
prompt-128 prefill module against torch fp32 on Mesa's lavapipe, unquantized and with int8 weights
(several rows: the dequantization in a dispatch of its own, src/edge/quant.py)."""
from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("iree.turbine")

from src.edge.bench import TOLERANCE, agreement, generate, reference_logits, relative_errors, tolerance, torch_greedy  # noqa: E402
from tests.support.lavapipe import in_own_process, needs_vulkan  # noqa: E402

STEPS = 8


def _tiny() -> dict:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    return OmegaConf.to_container(compose_config(["model=tiny"]).model, resolve=True)


def _generates(batch: int, prompt: int, dtype: str, quant: str, out: Path, cache: Path) -> dict:
    """Compile tiny for llvmpipe at (batch, prompt), prefill + STEPS greedy steps on lavapipe; the
    logits' largest relative error against torch fp32 (teacher-forced with the module's tokens) and
    against torch in the module's own format, and the steps on which every sequence's token is that
    format's torch's."""
    from src.edge.compile import build
    from src.edge.quant import fuse_dequantization, quantized_copy
    from src.edge.runtime import IreeRunner
    from src.edge.task import deployed, quant_setting, reference_model

    model = _tiny()
    settings = {"dtype": dtype, "quant": quant_setting(quant, 32, fuse_dequantization("vulkan", "llvmpipe"))}
    ref = reference_model(model, {"seed": 0}, prompt + STEPS, batch)
    art = build(deployed(ref, settings), model, prompt, dtype, "vulkan", "llvmpipe", "", out, cache)
    runner = IreeRunner(art, "vulkan")
    tokens = np.random.default_rng(2).integers(0, model["vocab_size"], (batch, prompt)).astype(np.int32)
    gen = generate(runner, tokens, STEPS, check=True)
    fed = gen.tokens[:-1]
    _, same_steps = agreement(gen.tokens, torch_greedy(deployed(ref, settings), tokens, STEPS))
    return {"rel_err": max(relative_errors(gen.logits, reference_logits(copy.deepcopy(ref), tokens, fed))),
            "rel_err_vs_format": max(relative_errors(gen.logits, reference_logits(quantized_copy(ref, settings["quant"]), tokens, fed))),
            "same_format_steps": same_steps, "shape": np.stack(gen.tokens).shape, "manifest_batch": art.manifest["batch"],
            "manifest_prompt": art.manifest["prompt_len"]}


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("edge_shapes_cache")


@needs_vulkan
@pytest.mark.parametrize("batch,prompt,dtype,quant", [
    (4, 16, "fp32", "none"),    # batch-4 decode: the projections a (4, in) x (in, out) matmul, not a matvec
    (4, 16, "fp32", "int8"),    # ... reading int8 weights dequantized in a dispatch of their own
    (1, 128, "fp32", "none"),   # prompt-128 prefill: the time to first token's module
    (1, 128, "fp32", "int8"),
])
def test_batch_four_decode_and_prompt_128_prefill_match_torch_on_lavapipe(batch, prompt, dtype, quant, tmp_path, cache):
    got = in_own_process(_generates, batch, prompt, dtype, quant, tmp_path / "art", cache)
    assert (got["manifest_batch"], got["manifest_prompt"]) == (batch, prompt) and got["shape"] == (STEPS + 1, batch)
    assert got["rel_err"] <= tolerance(dtype, quant), got
    assert got["rel_err_vs_format"] <= TOLERANCE[dtype], got
    # every sequence's every token: torch's in the module's own format
    assert got["same_format_steps"] == STEPS + 1, got
