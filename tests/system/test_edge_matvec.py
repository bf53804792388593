"""Products of a few rows as matrix-vector kernels (edge.matvec_rows, src/edge/matvec.py): the same
numbers as F.linear in torch, torch's tokens on lavapipe at batch 4, the refusals (what IREE makes of
them for an NVIDIA-class target: tests/system/test_edge_configs.py)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

pytest.importorskip("iree.turbine")

from src.edge.bench import TOLERANCE, generate, reference_logits, relative_errors  # noqa: E402
from src.edge.matvec import MatvecLinear, matvec_rows, use_matvec, weights_first  # noqa: E402
from src.edge.quant import QuantLinear, quant_spec, quantize  # noqa: E402
from src.edge.task import deployed, quant_setting, reference_model  # noqa: E402
from tests.support.cli import run_cli  # noqa: E402
from tests.support.lavapipe import in_own_process, needs_vulkan  # noqa: E402

PROMPT, STEPS, BATCH = 8, 16, 4


def _tiny() -> dict:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    return OmegaConf.to_container(compose_config(["model=tiny"]).model, resolve=True)


@pytest.mark.parametrize("rows", [1, 3, 8, 9])
def test_weights_first_is_f_linear(rows):
    torch.manual_seed(0)
    x, w, b = torch.randn(rows, 1, 40, dtype=torch.float64), torch.randn(24, 40, dtype=torch.float64), torch.randn(24, dtype=torch.float64)
    assert torch.allclose(weights_first(x, w, b), F.linear(x, w, b), rtol=0, atol=1e-12)
    lin = torch.nn.Linear(40, 24).double()
    want = lin(x)
    use_matvec(torch.nn.Sequential(lin), 8)
    assert type(lin) is MatvecLinear and lin.matvec_rows == 8
    assert torch.allclose(lin(x), want, rtol=0, atol=1e-12)


def test_use_matvec_keeps_parameters_names_and_tied_heads():
    lm = reference_model(_tiny(), {"seed": 0}, PROMPT + STEPS, BATCH)
    before = {k: v.clone() for k, v in lm.state_dict().items()}
    use_matvec(lm, 4)
    assert list(lm.state_dict()) == list(before) and all(torch.equal(lm.state_dict()[k], v) for k, v in before.items())
    assert type(lm.model.head) is MatvecLinear and matvec_rows(lm) == 4
    assert all(type(m) is not torch.nn.Linear for m in lm.modules())
    # off: nothing changes class
    plain = reference_model(_tiny(), {"seed": 0}, PROMPT + STEPS, BATCH)
    assert use_matvec(plain, 0) is plain and matvec_rows(plain) == 0 and type(plain.model.head) is torch.nn.Linear
    with pytest.raises(ValueError, match="edge.matvec_rows=9: IREE compiles products of at most 8 rows"):
        use_matvec(plain, 9)


@pytest.mark.parametrize("fmt", ["int8", "int4"])
@pytest.mark.parametrize("fuse", [True, False])
def test_quantized_linears_take_the_weights_first_form_with_the_same_numbers(fmt, fuse):
    torch.manual_seed(0)
    lin = torch.nn.Linear(64, 24, bias=True)
    q = QuantLinear(lin, fmt, 32, fuse)
    x = torch.randn(4, 1, 64)
    want = F.linear(x, q.dequantized(torch.float32), q.bias)
    q.matvec_rows = 4
    assert torch.allclose(q(x), want, rtol=1e-6, atol=1e-6)
    lm = quantize(reference_model(_tiny(), {"seed": 0}, PROMPT + STEPS, BATCH), fmt, 32)
    use_matvec(lm, 4)
    assert matvec_rows(lm) == 4 and quant_spec(lm)["format"] == fmt


def _generates_at_batch_4(dtype: str, quant: str, tmp_path: Path) -> dict:
    from src.edge.compile import build
    from src.edge.runtime import IreeRunner

    model = _tiny()
    settings = {"dtype": dtype, "quant": quant_setting(quant, 32, fused=False)}
    ref = reference_model(model, {"seed": 0}, PROMPT + STEPS, BATCH)
    art = build(use_matvec(deployed(ref, settings), 4), model, PROMPT, dtype, "vulkan", "llvmpipe", "", tmp_path / "art", tmp_path / "cache")
    runner = IreeRunner(art, "vulkan")
    tokens = np.random.default_rng(1).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    checked = generate(runner, tokens, STEPS, check=True)
    timed = generate(runner, tokens, STEPS)  # decode_token_into and prefill_token_into
    same_weights = deployed(ref, {"dtype": "fp32", "quant": settings["quant"]})
    want = reference_logits(same_weights, tokens, checked.tokens[:-1])
    return {"rel_err": max(relative_errors(checked.logits, want)), "variant": art.manifest["variant"],
            "tokens": [t.tolist() for t in checked.tokens], "timed": [t.tolist() for t in timed.tokens],
            "argmax": [w.argmax(-1).tolist() for w in want]}


@needs_vulkan
@pytest.mark.parametrize("dtype,quant", [("fp32", "none"), ("fp16", "int8")])
def test_batch_4_decode_through_matvecs_gives_torch_tokens_on_lavapipe(dtype, quant, tmp_path):
    got = in_own_process(_generates_at_batch_4, dtype, quant, tmp_path)
    assert got["variant"].startswith("llvmpipe-nocoop-matvec4"), got["variant"]
    # against torch fp32 with the module's weights (quantized or not): the dtype's tolerance
    assert got["rel_err"] <= TOLERANCE[dtype], got["rel_err"]
    assert got["tokens"] == got["argmax"] and got["timed"] == got["tokens"]


@pytest.mark.parametrize("args,line", [
    (["edge.matvec_rows=9"], "error: edge.matvec_rows=9: IREE compiles products of at most 8 rows as matvecs; use 0 (off) to 8"),
])
def test_a_matvec_setting_that_cannot_apply_is_refused_in_one_line(args, line, tmp_path):
    proc = run_cli(["+exp=edge", *args], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


def test_the_module_key_changes_with_matvec_rows():
    from src.edge.compile import module_key

    keys = {module_key(_tiny(), 4, PROMPT, PROMPT + STEPS, "fp16", "vulkan", [], quant=None, matvec_rows=r) for r in (0, 4, 8)}
    assert len(keys) == 3
