"""model=hf: a Hugging Face folder's architecture and shape taken from its config.json, as
transformers' Auto classes take them; the command line's own model.* settings applied on top and
checked against the checkpoint like any model's."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from src.config.compose import ConfigError, compose_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
REFERENCE = ROOT / "tests" / "support" / "hf_reference.py"
# a LLaMA no conf/model/*.yaml has: default RoPE (no 3.1 scaling), norm_eps 1e-6, 3 blocks of 6 heads sharing 2 KV heads
LLAMA = {"vocab_size": 256, "hidden_size": 96, "intermediate_size": 192, "num_hidden_layers": 3, "num_attention_heads": 6,
         "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
         "architectures": ["LlamaForCausalLM"]}


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    tmp = tmp_path_factory.mktemp("hf_auto")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(REFERENCE), "make", str(tmp / "llama"), json.dumps(LLAMA), "0"], cwd=tmp, env=env,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return tmp / "llama"


def test_a_checkpoint_of_a_shape_no_config_has_trains_with_model_hf_and_its_folder_alone(tmp_path, folder):
    run = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "src.run", "model=hf", f"model.hf_path={folder}", "train.steps=2", "data.seq_len=16",
                           "data.batch_size=2", "tracking=none", "train.progress=false", f"hydra.run.dir={run}"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    from omegaconf import OmegaConf

    model = OmegaConf.load(run / "config.yaml").model
    assert (model.arch, model.n_layers, model.n_heads, model.n_kv_heads, model.norm_eps, model.rope_factor, model.tie_embeddings) \
        == ("llama3", 3, 6, 2, 1e-6, 0.0, False)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["status"] == "finished" and summary["steps"] == 2


def test_settings_on_the_command_line_apply_and_are_checked_against_the_checkpoint(folder):
    from src.config.validate import validate
    from src.run import preflight

    cfg = compose_config(["model=hf", f"model.hf_path={folder}", "model.causal=false", "model.init_std=0.01"])
    assert (cfg.model.arch, cfg.model.causal, cfg.model.init_std, cfg.model.dim) == ("llama3", False, 0.01, 96)
    validate(cfg, cuda_device_count=0, mps_available=False)
    with pytest.raises(ConfigError) as err:
        preflight(["model=hf", f"model.hf_path={folder}", "model.n_layers=2"], multirun=False)
    assert str(err.value) == (f"model.hf_path={folder}: model=hf has model.n_layers=2 (the checkpoint's 3); "
                              "drop those settings: the shape is the folder's")
    with pytest.raises(ConfigError, match=r"^model.ffn_mult: not a setting of model.arch=llama3 \(config.json's architecture\); drop it$"):
        compose_config(["model=hf", f"model.hf_path={folder}", "+model.ffn_mult=2"])


def test_a_folder_it_cannot_read_is_refused_in_one_line(tmp_path):
    with pytest.raises(ConfigError, match=r"^model=hf reads the architecture and the shape from a Hugging Face folder: set model.hf_path=DIR$"):
        compose_config(["model=hf"])
    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"], "n_embd": 64}))
    with pytest.raises(ConfigError, match=r"architectures=\['GPT2LMHeadModel'\]; read are LlamaForCausalLM, Qwen2ForCausalLM"):
        compose_config(["model=hf", f"model.hf_path={tmp_path / 'gpt2'}"])
    with pytest.raises(ConfigError, match="no such folder"):
        compose_config(["model=hf", f"model.hf_path={tmp_path / 'nowhere'}"])
