"""The Qwen3 family (src/models/qwen3/, conf/model/qwen3_0_6b.yaml) against transformers' own
Qwen3ForCausalLM on a random checkpoint it makes: the logits in fp32 to 1e-5 (q and k RMS-normed per
head before the rotation, a head width that is not dim / heads), the folder in and out bit-exact, a
run from it with model=hf; and the family added by its folder and its YAML alone."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from src.config.compose import compose_config  # noqa: E402
from src.models import architecture, build_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "support" / "hf_reference.py"
QWEN3 = {"vocab_size": 300, "hidden_size": 64, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 4,
         "num_key_value_heads": 2, "head_dim": 24, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": True,
         "architectures": ["Qwen3ForCausalLM"]}


def _reference(*args: str, cwd: Path) -> None:
    """tests/support/hf_reference.py in a process of its own, started outside the repository."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(REFERENCE), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _logits(tmp_path: Path, folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    torch.save(tokens, tmp_path / "tokens.pt")
    _reference("logits", str(folder), str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt"), cwd=tmp_path)
    return torch.load(tmp_path / "logits.pt")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory) -> Path:
    """A random Qwen3ForCausalLM saved by transformers (its norms moved off ones, so a norm read from
    the wrong tensor shows)."""
    tmp = tmp_path_factory.mktemp("qwen3")
    _reference("make", str(tmp / "hf"), json.dumps(QWEN3), "0", cwd=tmp)
    return tmp / "hf"


def _ours(folder: Path) -> torch.nn.Module:
    cfg = compose_config(["model=hf", f"model.hf_path={folder}"])
    from src.models.config import resolve

    model_cfg = resolve(cfg, ["model=hf"]).model
    assert model_cfg.arch == "qwen3" and model_cfg.head_dim == 24 and model_cfg.tie_embeddings
    model = build_model(model_cfg)
    assert architecture("qwen3").hf.load(model, folder) == len(list(model.parameters()))
    return model.eval()


def test_logits_equal_transformers_in_fp32(tmp_path, checkpoint):
    tokens = torch.randint(0, 300, (2, 33), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ours = _ours(checkpoint)(tokens)
    torch.testing.assert_close(ours, _logits(tmp_path, checkpoint, tokens), rtol=1e-5, atol=1e-5)


def test_the_folder_out_is_the_folder_in_bit_for_bit(tmp_path, checkpoint):
    from safetensors.torch import load_file

    model = _ours(checkpoint)
    cfg = compose_config(["model=hf", f"model.hf_path={checkpoint}"])
    from src.models.config import resolve

    model_cfg = dict(resolve(cfg, ["model=hf"]).model)
    out = architecture("qwen3").hf.save(model, model_cfg, model.state_dict(), tmp_path / "ours")
    theirs, mine = load_file(checkpoint / "model.safetensors"), load_file(out / "model.safetensors")
    assert set(mine) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding, saved once
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    tokens = torch.randint(0, 300, (1, 20), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_logits(tmp_path, out, tokens), _logits(tmp_path, checkpoint, tokens), rtol=0, atol=0)


def test_a_run_starts_from_the_folder_with_model_hf_alone(tmp_path, checkpoint):
    """python -m src.run model=hf model.hf_path=DIR: the family and the shape from config.json, the
    weights from the folder, every parameter of the checkpoint in the model trained."""
    from safetensors.torch import load_file

    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "src.run", "model=hf", f"model.hf_path={checkpoint}", "train.steps=2", "data.seq_len=16",
                           "data.batch_size=2", "precision=fp32", "tracking=none", "train.progress=false", f"hydra.run.dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"parameters read from {checkpoint}" in proc.stderr + proc.stdout
    summary = json.loads((run / "summary.json").read_text())
    tensors = load_file(checkpoint / "model.safetensors")
    assert summary["settings"]["model"] == "hf" and summary["params"] == sum(t.numel() for t in tensors.values())
    saved = (run / "config.yaml").read_text()
    assert "arch: qwen3" in saved and "head_dim: 24" in saved  # the resolved model: what export and resume read


def test_no_file_outside_its_folder_and_its_yaml_names_the_family():
    """Adding an architecture is its folder and a YAML: no other code, config or packaging file of the
    repository knows Qwen3 (the docs and the lab's notes may report its figures)."""
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    own = ("src/models/qwen3/", "conf/model/qwen3_0_6b.yaml", Path(__file__).relative_to(ROOT).as_posix())
    code = [f for f in tracked if not f.startswith(own) and not f.endswith(".md") and (ROOT / f).is_file()]
    assert len(code) > 100 and "setup.py" in code and "pyproject.toml" in code
    assert [f for f in code if "qwen3" in (ROOT / f).read_bytes().decode("utf-8", "replace").lower()] == []
