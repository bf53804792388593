"""What IREE compiles for `pascal` (NVIDIA without cooperative matrices, as the H200 runs fp16) from
tiny's fp16 module at batch 4 and an 8-token prompt, read from its dumped configurations: with
edge.matvec_rows=4 every decode weight product is a SubgroupReduce matvec (IREE's general matmul
pipeline without it), and with src/edge/tiles.py's library the prefill's products of the batch's 32
prompt rows take its tiles and no other product does. Two compiles, shared by both tests."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

pytest.importorskip("iree.turbine")

from src.edge.matvec import use_matvec  # noqa: E402
from src.edge.task import deployed, reference_model  # noqa: E402
from src.edge.tiles import prefill_tiles_flag  # noqa: E402

BATCH, PROMPT, STEPS = 4, 8, 4


def _tiny() -> dict:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    return OmegaConf.to_container(compose_config(["model=tiny"]).model, resolve=True)


def _configurations(tmp: Path, levers: bool) -> dict[str, tuple[str, str]]:
    """Each executable with a product -> (IREE's pipeline, its first-level tile sizes)."""
    from src.edge.compile import build

    model = _tiny()
    lm = deployed(reference_model(model, {"seed": 0}, PROMPT + STEPS, BATCH), {"dtype": "fp16"})
    dump = tmp / f"configs-{levers}"
    flags = (f"--iree-hal-dump-executable-configurations-to={dump}",)
    if levers:
        use_matvec(lm, BATCH)
        flags += (prefill_tiles_flag(tmp / "lib", BATCH * PROMPT, (16, 64), "fp16", (1, BATCH * model["n_heads"])),)
    art = build(lm, model, PROMPT, "fp16", "vulkan", "pascal", "", tmp / f"art-{levers}", tmp / "cache", {"seed": 0}, flags, params=False)
    assert art.manifest["variant"] == ("pascal-nocoop-tiles16x64-matvec4" if levers else "pascal-nocoop"), art.manifest["variant"]
    found = {}
    for f in dump.glob("*.mlir"):
        text = f.read_text()
        name = re.search(r"hal\.executable\.export public @(\S+)", text).group(1)
        if "matmul" in name:
            found[name] = (re.search(r"spirv_pipeline<(\w+)>", text).group(1), re.findall(r"tile_sizes = \[\[([^\]]*)\]", text)[-1])
    return found


@pytest.fixture(scope="module")
def configs(tmp_path_factory) -> dict[bool, dict[str, tuple[str, str]]]:
    tmp = tmp_path_factory.mktemp("edge_configs")
    return {levers: _configurations(tmp, levers) for levers in (False, True)}


def _decode_weight_products(found: dict[str, tuple[str, str]]) -> dict[str, str]:
    # decode's products with the weights are `matmul`s, (rows x in) by (in x out) either way round;
    # attention's are batch_matmuls over (sequences x heads)
    return {name: pipe for name, (pipe, _) in found.items() if name.startswith("decode$async") and "_matmul_" in name and "batch_matmul" not in name}


def test_decode_weight_products_at_batch_4_compile_as_matvecs(configs):
    plain, matvec = _decode_weight_products(configs[False]), _decode_weight_products(configs[True])
    assert plain and "MatmulPromoteVectorize" in plain.values(), plain
    assert matvec and set(matvec.values()) == {"SubgroupReduce"}, matvec
    # the transposed products: out x rows, one workgroup per (output, row)
    assert any(re.search(rf"matmul_\d+x{BATCH}x\d+_f16", name) for name in matvec), matvec


def test_the_library_tiles_the_prompts_products_and_no_other(configs):
    own, tiled = configs[False], configs[True]
    prefill = {name: tiles for name, (_, tiles) in tiled.items() if name.startswith("prefill$async")}
    # the projections' products over the prompt's BATCH x PROMPT rows: the library's tiles, IREE's own without it
    of_rows = [name for name in prefill if re.search(rf"_matmul_{BATCH * PROMPT}x\d+x\d+_f16", name)]
    assert len(of_rows) >= 4 and all(prefill[name] == "16, 64, 32" != own[name][1] for name in of_rows), (own, prefill)
    # every other product (attention's over one sequence's PROMPT rows) as IREE chose it
    others = [name for name in prefill if name not in of_rows and name in own]
    assert others and all(prefill[name] == own[name][1] for name in others), (own, prefill)


def _int4_decode(tmp: Path, batch: int) -> dict[str, tuple[str, bool]]:
    """tiny's int4 (groups of 32) fp16 decode for `pascal` at `batch` (edge.matvec_rows=batch past
    one): each dispatch -> (IREE's pipeline, whether it reads an i4 tensor)."""
    from src.edge.compile import build

    model = _tiny()
    quant = {"format": "int4", "fused": True, "group_size": 32}
    lm = deployed(reference_model(model, {"seed": 0}, PROMPT + STEPS, batch), {"dtype": "fp16", "quant": quant})
    if batch > 1:
        use_matvec(lm, batch)
    configs, sources = tmp / f"int4-configs-{batch}", tmp / f"int4-sources-{batch}"
    flags = (f"--iree-hal-dump-executable-configurations-to={configs}", f"--iree-hal-dump-executable-sources-to={sources}")
    build(lm, model, PROMPT, "fp16", "vulkan", "pascal", "", tmp / f"int4-art-{batch}", tmp / "cache", {"seed": 0}, flags,
          params=False, functions=("decode",))
    found = {}
    for f in configs.glob("*.mlir"):
        text = f.read_text()
        name = re.search(r"hal\.executable\.export public @(\S+)", text).group(1)
        pipeline = re.search(r"spirv_pipeline<(\w+)>", text)
        found[name] = (pipeline.group(1) if pipeline else "", "xi4>" in (sources / f.name.removeprefix("configured_")).read_text())
    return found


@pytest.mark.parametrize("batch", [1, BATCH])
def test_int4_weights_are_read_as_i4_inside_each_decode_matvec(batch, tmp_path):
    """src/edge/int4.py and QuantLinear's grouped product: every Linear of tiny's decode (the fused
    q/k/v with the norm before it, the output projection, the MLP's two) is one SubgroupReduce
    dispatch that reads the i4 weight; no dispatch dequantizes one apart."""
    found = _int4_decode(tmp_path, batch)
    reading = {name: pipeline for name, (pipeline, i4) in found.items() if i4}
    assert len(reading) == 4 and set(reading.values()) == {"SubgroupReduce"}, found
    assert not [name for name in reading if "elementwise" in name], reading
