"""Every architecture of src/models/ against the contract in src/models/protocol.py, found the way
the code finds them (a folder with config.py and architecture.py): its config's fields are what its
constructor reads, its model and blocks are the CausalLM, Block and Attention the rest of the code
reads, and the edge KV cache decodes as the model runs the whole sequence."""
from __future__ import annotations

import inspect
from dataclasses import fields
from pathlib import Path

import pytest
import torch

from src.config.compose import compose_config
from src.models import ARCHS, build_model
from src.models.config import arch_configs
from src.models.protocol import Attention, Block, CausalLM

CONF = Path(__file__).resolve().parents[2] / "conf" / "model"


def _small(arch: str, **extra) -> list[str]:
    """Overrides that make the first conf/model/*.yaml of `arch` a model of a few thousand parameters."""
    schema = arch_configs()[arch]
    first = next(p.stem for p in sorted(CONF.glob("*.yaml")) if f"/base_model_{arch}@" in p.read_text())
    names = {f.name for f in fields(schema)}
    small = {"dim": 64, "n_layers": 2, "n_heads": 4, "vocab_size": 96, "ffn_hidden": 96, "n_kv_heads": 2, "head_dim": 24,
             "rope_factor": 8.0, "rope_original_len": 8, "rope_theta": 10000.0, "tie_embeddings": True, **extra}
    return [f"model={first}", *[f"model.{k}={v}" for k, v in small.items() if k in names]]


def test_every_folder_with_a_config_is_an_architecture_and_its_yaml_pulls_its_schema():
    folders = sorted(p.parent.name for p in (Path(__file__).resolve().parents[2] / "src" / "models").glob("*/config.py"))
    assert sorted(ARCHS) == sorted(arch_configs()) == folders
    for arch in ARCHS:
        cfg = compose_config(_small(arch))
        assert cfg.model.arch == arch and cfg.model._metadata.object_type is arch_configs()[arch]


@pytest.mark.parametrize("arch", sorted(arch_configs()))
def test_a_config_holds_what_its_constructor_reads(arch):
    """Each field of the architecture's dataclass is a constructor argument of its model, or says
    where the weights come from (hf_path) or names the config (name, arch)."""
    reads = set(inspect.signature(ARCHS[arch].model.__init__).parameters) - {"self"}
    held = {f.name for f in fields(arch_configs()[arch])}
    assert held - reads <= {"name", "arch", "hf_path"}
    assert reads <= held, f"constructor arguments no setting reaches: {reads - held}"


@pytest.mark.parametrize("arch", sorted(arch_configs()))
def test_model_blocks_and_attention_are_what_the_protocol_says(arch):
    model = build_model(compose_config(_small(arch)).model)
    assert isinstance(model, CausalLM)
    assert all(isinstance(b, Block) and isinstance(b.attn, Attention) for b in model.layers)
    assert isinstance(model.new_block(), type(model.layers[0]))
    init = {n: model.param_init(n)[0] for n, _ in model.named_parameters()}
    norms = [n for n, p in model.named_parameters() if p.dim() == 1 and "norm" in n]
    assert all(init[n] == "ones" for n in norms), "a norm not initialised to ones"
    x = torch.randn(2, 5, 64)
    q, k, v = model.layers[0].attn.heads(x, torch.arange(5))
    a = model.layers[0].attn
    assert q.shape == (2, a.n_heads, 5, a.head_dim) and k.shape == v.shape == (2, a.n_kv_heads, 5, a.head_dim)


@pytest.mark.parametrize("n_kv_heads", [1, 4])
@pytest.mark.parametrize("arch", sorted(arch_configs()))
def test_the_edge_kv_cache_decodes_as_the_model_runs_the_whole_sequence(arch, n_kv_heads):
    """src/edge/model.py reads a block only through the protocol: prefill, then each decode step
    writing its token's keys and values (n_kv_heads of them, rotated where the family rotates) at its
    position, gives the full forward's logits at every position, for every architecture."""
    from src.distributed.parallelize import materialize_and_init
    from src.edge.model import EdgeLM
    from src.models import meta_model

    model = meta_model(compose_config(_small(arch, n_kv_heads=n_kv_heads)).model)
    materialize_and_init(model, torch.device("cpu"), seed=3)
    tokens = torch.randint(0, 96, (2, 12), generator=torch.Generator().manual_seed(4))
    with torch.no_grad():
        full = model(tokens)  # (B, T, V)
        lm = EdgeLM(model.eval(), max_seq=16, batch=2)
        attn = model.layers[0].attn
        assert tuple(lm.k_cache.shape) == (2, 2, attn.n_kv_heads, 16, attn.head_dim)
        _, logits = lm.prefill(tokens[:, :5].to(torch.int32))
        steps = [logits]
        for i in range(5, 12):
            _, logits = lm.decode(tokens[:, i].to(torch.int32), torch.tensor([i], dtype=torch.int32))
            steps.append(logits)
    for i, logits in enumerate(steps):
        torch.testing.assert_close(logits, full[:, 4 + i], rtol=1e-5, atol=1e-5)


def test_a_setting_of_another_architecture_fails_when_composed_and_a_switched_arch_is_refused():
    from src.config.compose import ConfigError
    from src.models.checks import model_refusal

    with pytest.raises(ConfigError, match=r"model.n_kv_heads=2: unknown key 'model.n_kv_heads'; valid keys in model: .*ffn_mult"):
        compose_config(["model=tiny", "model.n_kv_heads=2"])
    line = model_refusal(compose_config(["model=tiny", "model.arch=llama3"]).model)
    assert line.startswith("model.arch=llama3, and model=tiny holds mini_llm's settings") and "\n" not in line
    assert model_refusal(compose_config(["model=tiny", "model.arch=gpt9"]).model).startswith("model.arch=gpt9: no such architecture; one of ")
