"""The prefill's matmul tiles through an IREE transform library (src/edge/tiles.py): the tiled module
gives torch's tokens on lavapipe, the flag's path and name, the tiles refused (what IREE makes of the
library for `pascal`: tests/system/test_edge_configs.py)."""
from __future__ import annotations

import copy
import re
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("iree.turbine")

from src.edge.bench import TOLERANCE, generate, reference_logits, relative_errors  # noqa: E402
from src.edge.task import deployed, reference_model  # noqa: E402
from src.edge.tiles import LIBRARY_FLAG, flag_name, library, prefill_tiles_flag  # noqa: E402
from tests.support.lavapipe import in_own_process, needs_vulkan  # noqa: E402

PROMPT, STEPS = 32, 8


def _tiny() -> dict:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    return OmegaConf.to_container(compose_config(["model=tiny"]).model, resolve=True)


def test_the_flag_is_named_by_its_content_and_names_the_variant(tmp_path):
    flag = prefill_tiles_flag(tmp_path, 128, (16, 64), "fp16", (1, 8))
    assert flag.startswith(LIBRARY_FLAG) and flag == prefill_tiles_flag(tmp_path, 128, (16, 64), "fp16", (8, 1))
    assert flag != prefill_tiles_flag(tmp_path, 128, (32, 64), "fp16", (1, 8)) and len(list(tmp_path.iterdir())) == 2
    assert flag_name(flag) == "tiles16x64" and flag_name("--iree-opt-level=O2") is None
    from src.edge.compile import default_variant

    assert default_variant("pascal", False, (flag,)) == "pascal-nocoop-tiles16x64"
    text = Path(flag.removeprefix(LIBRARY_FLAG)).read_text()
    # one matcher for products with no batch dim, one per batch given; 16 x 64 outputs on 16 x 4 threads
    assert len(re.findall(r"dims_equal %m, \[128\]", text)) == 3 and "tile_sizes = [[1, 16, 64, 32]]" in text and "workgroup_size = [16, 4, 1]" in text
    assert "lhs_type = f16, rhs_type = f16, output_type = f32" in text


@pytest.mark.parametrize("tile,why", [((10, 64), "both sides a multiple of 4"), ((128, 256), "2048 threads a workgroup, more than 1024")])
def test_tiles_a_workgroup_cannot_take_are_refused(tile, why):
    with pytest.raises(ValueError, match=why):
        library(128, tile, "fp16", (1,))


def _generates_tiled(dtype: str, tmp_path: Path) -> dict:
    from src.edge.compile import build
    from src.edge.runtime import IreeRunner

    model = _tiny()
    ref = reference_model(model, {"seed": 0}, PROMPT + STEPS, 1)
    flag = prefill_tiles_flag(tmp_path / "lib", PROMPT, (16, 64), dtype, (1, model["n_heads"]))
    art = build(deployed(ref, {"dtype": dtype}), model, PROMPT, dtype, "vulkan", "llvmpipe", "", tmp_path / "art", tmp_path / "cache", {"seed": 0}, (flag,))
    runner = IreeRunner(art, "vulkan")
    tokens = np.random.default_rng(1).integers(0, 256, (1, PROMPT)).astype(np.int32)
    gen = generate(runner, tokens, STEPS, check=True)
    want = reference_logits(copy.deepcopy(ref), tokens, gen.tokens[:-1])
    return {"rel_err": max(relative_errors(gen.logits, want)), "variant": art.manifest["variant"],
            "tokens": [t.tolist() for t in gen.tokens], "argmax": [w.argmax(-1).tolist() for w in want]}


@needs_vulkan
def test_a_tiled_prefill_gives_torch_tokens_on_lavapipe(tmp_path):
    got = in_own_process(_generates_tiled, "fp32", tmp_path)
    assert got["variant"] == "llvmpipe-nocoop-tiles16x64" and got["rel_err"] <= TOLERANCE["fp32"], got
    assert got["tokens"] == got["argmax"], got


def test_a_run_tiles_its_prefill_where_a_tile_was_measured_and_leaves_the_rest_to_iree(tmp_path):
    from src.edge.tiles import MEASURED_TILES, default_prefill_flags, flag_name

    (flag,) = default_prefill_flags(tmp_path, "pascal", "fp16", 4 * 32, n_heads=8, batch=4)
    assert flag_name(flag) == "tiles{}x{}".format(*MEASURED_TILES[("pascal", "fp16")])
    assert "dims_equal %m, [128]" in Path(flag.split("=", 1)[1]).read_text()  # the prefill's batch x prompt rows
    assert "dims_equal %batch, [32]" in Path(flag.split("=", 1)[1]).read_text()  # attention's sequences x heads
    assert default_prefill_flags(tmp_path, "llvmpipe", "fp16", 128, 8, 1) == ()  # no measured tile: IREE's own
    assert default_prefill_flags(tmp_path, "pascal", "fp32", 128, 8, 1) == ()
    assert default_prefill_flags(tmp_path, "pascal", "fp16", 8, 8, 1) == ()  # a matvec's rows
