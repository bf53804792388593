"""The LLaMA 3 family (src/models/llama3/) against transformers' own LlamaForCausalLM and
Qwen2ForCausalLM on random checkpoints they make and save: the logits in fp32 to 1e-5 (RoPE with
LLaMA 3.1's scaling, grouped-query attention, tied and untied heads, Qwen's q/k/v biases); Hugging
Face checkpoints in (single file and sharded index) and out, the round trip bit-exact; each rank of
an FSDP2 run reading only its own rows; shapes that do not match refused in one line."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

pytest.importorskip("transformers")  # the reference: pip install -e ".[test]"

from src.config.compose import ConfigError, compose_config  # noqa: E402
from src.config.validate import validate  # noqa: E402
from src.models import build_model  # noqa: E402
from src.models.config import hf_config  # noqa: E402
from src.models.llama3.hf import HF  # noqa: E402
from tests.support.ranks import spawn_ranks  # noqa: E402

REFERENCE = Path(__file__).parents[1] / "support" / "hf_reference.py"
TINY = {"vocab_size": 256, "hidden_size": 64, "intermediate_size": 176, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "tie_word_embeddings": True,
        "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                         "original_max_position_embeddings": 64},
        "architectures": ["LlamaForCausalLM"]}
QWEN = {"vocab_size": 300, "hidden_size": 96, "intermediate_size": 160, "num_hidden_layers": 2, "num_attention_heads": 6,
        "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1000000.0, "tie_word_embeddings": False,
        "architectures": ["Qwen2ForCausalLM"]}


def _reference(*args: str, cwd: Path) -> None:
    """tests/hf_reference.py in a process of its own, started outside the repository."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    proc = subprocess.run([sys.executable, str(REFERENCE), *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]


def _hf_checkpoint(tmp_path: Path, config: dict, name: str, max_shard: str | None = None) -> Path:
    folder = tmp_path / name
    _reference("make", str(folder), json.dumps(config), "0", *([max_shard] if max_shard else []), cwd=tmp_path)
    return folder


def _hf_logits(tmp_path: Path, folder: Path, tokens: torch.Tensor) -> torch.Tensor:
    torch.save(tokens, tmp_path / "tokens.pt")
    _reference("logits", str(folder), str(tmp_path / "tokens.pt"), str(tmp_path / "logits.pt"), cwd=tmp_path)
    return torch.load(tmp_path / "logits.pt")


def _ours(folder: Path) -> torch.nn.Module:
    fields = HF.model_fields(hf_config(folder))
    model = build_model(compose_config(["model=llama3_tiny", *[f"model.{k}={v}" for k, v in fields.items()]]).model)
    HF.load(model, folder)
    return model.eval()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_the_rotary_table_made_once_a_model_equals_each_block_making_its_own(dtype):
    model = build_model(compose_config(["model=llama3_tiny"]).model).to(dtype)
    tokens = torch.randint(0, 256, (2, 37), generator=torch.Generator().manual_seed(0))
    outs, grads = [], []
    for blocks_make_it in (False, True):
        model.zero_grad()
        if blocks_make_it:  # what a block called on x alone does (kernels=auto's block timing)
            x = model.embed(tokens)
            for layer in model.layers:
                x = layer(x)
            out = model.head(model.norm(x))
        else:
            out = model(tokens)
        out.float().square().mean().backward()
        outs.append(out)
        grads.append([p.grad.clone() for p in model.parameters()])
    torch.testing.assert_close(outs[0], outs[1], rtol=0, atol=0)  # the same bits
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert model.rotary_table(37, tokens.device) is model.rotary_table(37, tokens.device)  # made once, kept
    assert model.rotary_table(37, tokens.device)[0].dtype == torch.float32


@pytest.mark.parametrize("config, name", [(TINY, "llama"), (QWEN, "qwen2")])
def test_logits_equal_transformers_in_fp32(tmp_path, config, name):
    folder = _hf_checkpoint(tmp_path, config, name)
    tokens = torch.randint(0, config["vocab_size"], (2, 80), generator=torch.Generator().manual_seed(1))  # 80 > 64: past the scaled band
    with torch.no_grad():
        ours = _ours(folder)(tokens)
    theirs = _hf_logits(tmp_path, folder, tokens)
    assert ours.shape == theirs.shape == (2, 80, config["vocab_size"])
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


def test_a_sharded_checkpoint_reads_and_the_round_trip_is_bit_exact(tmp_path):
    """transformers' sharded save (an index and several files) in; ours out; transformers reads ours
    with the same logits, and every tensor of ours is the checkpoint's, bit for bit."""
    from safetensors.torch import load_file

    folder = _hf_checkpoint(tmp_path, TINY, "sharded", max_shard="60KB")
    assert (folder / "model.safetensors.index.json").is_file()
    model = _ours(folder)
    out = HF.save(model, dict(compose_config(["model=llama3_tiny"]).model), model.state_dict(), tmp_path / "ours")
    theirs = {}
    for f in json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"].values():
        theirs.update(load_file(folder / f))
    mine = load_file(out / "model.safetensors")
    assert set(mine) == set(theirs) - {"lm_head.weight"}  # tied: lm_head is the embedding, saved once
    assert all(torch.equal(mine[k], theirs[k]) for k in mine)
    tokens = torch.randint(0, 256, (1, 40), generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(_hf_logits(tmp_path, out, tokens), _hf_logits(tmp_path, folder, tokens), rtol=0, atol=0)


def _rank(rank: int, init_file: str, out: str, folder: str) -> None:
    import torch.distributed as dist

    from src.distributed.parallelize import parallelize

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=3)
    try:
        fields = HF.model_fields(hf_config(Path(folder)))
        cfg = compose_config(["model=llama3_tiny", f"model.hf_path={folder}", "dist.nproc=3",
                              *[f"model.{k}={v}" for k, v in fields.items()]])
        from src.distributed.env import build_mesh

        with torch.device("meta"):
            model = build_model(cfg.model)
        model = parallelize(model, cfg, build_mesh("cpu", 3, "fsdp2", replicate=1), torch.device("cpu")).model
        local = {n: p.to_local().clone() for n, p in model.named_parameters()}
        full = {n: p.full_tensor() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"full": full}, out)
        torch.save(local, f"{out}.{rank}")
    finally:
        dist.destroy_process_group()


def test_fsdp2_ranks_read_only_their_own_rows(tmp_path):
    """Three gloo ranks (rows that do not split evenly: the last shard short): each rank's shard is
    the checkpoint's rows for it, and together they are the unsharded model's weights."""
    folder = _hf_checkpoint(tmp_path, QWEN, "qwen")
    out = tmp_path / "ranks.pt"
    spawn_ranks(_rank, (str(tmp_path / "init"), str(out), str(folder)), 3)
    full = torch.load(out)["full"]
    plain = dict(_ours(folder).named_parameters())
    assert set(full) == set(plain)
    for name, p in plain.items():
        assert torch.equal(full[name], p.detach()), name
        rows = -(-p.shape[0] // 3)
        for rank in range(3):
            local = torch.load(f"{out}.{rank}")[name]
            assert torch.equal(local, p.detach()[rank * rows: (rank + 1) * rows]), (name, rank)


def test_a_checkpoint_of_another_shape_is_refused_in_one_line(tmp_path):
    folder = _hf_checkpoint(tmp_path, QWEN, "qwen")
    cfg = compose_config(["model=llama3_tiny", f"model.hf_path={folder}"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_device_count=0, mps_available=False)
    line = str(err.value)
    assert "\n" not in line and line.startswith(f"model.hf_path={folder}: model=llama3_tiny has model.vocab_size=256 (the checkpoint's 300)")
    assert "model.qkv_bias=False (the checkpoint's True)" in line
    with pytest.raises(ConfigError, match="no config.json there"):
        validate(compose_config(["model=llama3_tiny", f"model.hf_path={tmp_path}"]), cuda_device_count=0, mps_available=False)
    with pytest.raises(ConfigError, match="model.hf_path=.*: model.arch=mini_llm reads no Hugging Face folder"):
        validate(compose_config(["model=tiny", f"model.hf_path={folder}"]), cuda_device_count=0, mps_available=False)


LLAMA = dict(vocab_size=97, dim=48, n_layers=2, n_heads=6, n_kv_heads=2, ffn_hidden=80, rope_theta=10000.0, rope_factor=8.0,
             rope_original_len=16, tie_embeddings=True)
BATCH, SEQ, STEPS, SEED = 3, 17, 3, 7


def _fsdp_rank(rank: int, init_file: str, out: str) -> None:
    import gc

    import torch.distributed as dist

    from src.data.batches import TokenBatches
    from src.distributed.env import build_mesh
    from src.distributed.parallelize import apply_fsdp, materialize_and_init, mixed_precision_policy
    from src.models.llama3.model import Llama3
    from src.train.loop import train_step

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    model = opt = None
    try:
        with torch.device("meta"):
            model = Llama3(**LLAMA)
        apply_fsdp(model, build_mesh("cpu", 2, "fsdp2", replicate=1), mixed_precision_policy("float32", "float32"))
        materialize_and_init(model, torch.device("cpu"), SEED)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        batches = TokenBatches("random", LLAMA["vocab_size"], BATCH, SEQ, SEED, rank, 2)
        losses = []
        for _ in range(STEPS):
            x, y = next(batches)
            loss, _ = train_step(model, opt, x, y, grad_clip=1.0)
            dist.all_reduce(loss, op=dist.ReduceOp.AVG)
            losses.append(loss.item())
        full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        if rank == 0:
            torch.save({"losses": losses, "params": full}, out)
    finally:
        del model, opt
        gc.collect()
        dist.destroy_process_group()


def test_fsdp2_on_two_gloo_ranks_trains_as_the_unsharded_model(tmp_path):
    """LLaMA 3 with grouped-query attention and a tied head (one Parameter in the root's FSDP2 unit):
    the same losses and weights, fp32, step for step, as one process over the global batch."""
    from src.data.batches import TokenBatches
    from src.distributed.parallelize import materialize_and_init
    from src.models.llama3.model import Llama3
    from src.train.loop import train_step

    spawn_ranks(_fsdp_rank, (str(tmp_path / "init"), str(tmp_path / "out.pt")), 2)
    sharded = torch.load(tmp_path / "out.pt")
    with torch.device("meta"):
        model = Llama3(**LLAMA)
    materialize_and_init(model, torch.device("cpu"), SEED)
    assert model.head.weight is model.embed.weight
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    batches = TokenBatches("random", LLAMA["vocab_size"], BATCH * 2, SEQ, SEED, 0, 1)
    losses = []
    for _ in range(STEPS):
        x, y = next(batches)
        loss, _ = train_step(model, opt, x, y, grad_clip=1.0)
        losses.append(loss.item())
    assert sharded["losses"] == pytest.approx(losses, rel=1e-5)
    assert losses[-1] < losses[0]
    for name, p in model.named_parameters():
        torch.testing.assert_close(sharded["params"][name], p.detach(), rtol=1e-4, atol=1e-5)


# parameters of the real models these configs describe (their model cards), each shared weight once
SIZES = {"llama3_1b": 1_235_814_400, "llama3_3b": 3_212_749_824, "llama3_8b": 8_030_261_248, "qwen2_5_0_5b": 494_032_768}


@pytest.mark.parametrize("name", list(SIZES))
def test_each_family_config_composes_at_its_real_size_and_counts_its_flops(name):
    cfg = compose_config([f"model={name}", "backend=cuda"])
    with torch.device("meta"):
        model = build_model(cfg.model)
    assert model.num_params(non_embedding=False) == SIZES[name]
    m, T = cfg.model, 2048
    head_dim = m.head_dim or m.dim // m.n_heads
    # 6 x the weights a token multiplies (the tied head's too) + attention's 12 x L x H x hd x T
    matmul = SIZES[name] - m.vocab_size * m.dim + (m.vocab_size * m.dim if m.tie_embeddings else 0)
    assert model.flops_per_token(T) == 6 * matmul + 12 * m.n_layers * m.n_heads * head_dim * T


@pytest.mark.parametrize("overrides, message", [
    (["model=llama3_tiny", "model.n_kv_heads=3"], "model.n_kv_heads=3 does not divide model.n_heads=4: grouped-query attention"),
    (["model=tiny", "model.n_kv_heads=2"], "model.n_kv_heads=2: unknown key 'model.n_kv_heads'; valid keys in model: "),
    (["model=llama3_tiny", "model.mlp=silu"], "model.mlp=silu: the LLaMA 3 family's MLP is swiglu"),
    (["model=llama3_tiny", "sharding.split_root=true"], "sharding.split_root=true puts the embedding and the head in FSDP2 units of their own, "
                                                          "and model=llama3_tiny ties them (one weight): set sharding.split_root=false"),
    (["model=llama3_tiny", "model.n_heads=0"], "model.dim, n_layers, n_heads and vocab_size must all be positive"),
])
def test_a_wrong_shape_is_refused_in_one_line(overrides, message):
    from src.run import preflight

    with pytest.raises(ConfigError) as err:
        preflight(overrides, multirun=False)
    assert message in str(err.value) and "\n" not in str(err.value)


def test_a_trained_checkpoint_exports_to_a_folder_transformers_reads(tmp_path, in_process_runs):
    """model=llama3_tiny trained 2 steps on one rank, saved (DCP), exported with --hf: transformers'
    LlamaForCausalLM gives the logits our model gives with the same weights."""
    from safetensors.torch import load_file

    from src.export import main as export
    from src.runtime import RunContext
    from src.train.worker import train

    run_dir = tmp_path / "run"
    run_dir.mkdir()
    cfg = compose_config(["model=llama3_tiny", "dist.nproc=1", "precision=fp32", "train.steps=2", "data.seq_len=32", "data.batch_size=2",
                          "tracking=none", "train.progress=false", "checkpoint.enabled=true"])
    train(cfg, RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
    step = run_dir / "checkpoints" / "step_00000002"
    assert export([str(step), "--hf", "--out", str(tmp_path / "hf")]) == 0
    assert export([str(step), "--out", str(tmp_path / "plain.safetensors")]) == 0
    model = build_model(cfg.model)
    model.load_state_dict(load_file(tmp_path / "plain.safetensors"))
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ours = model.eval()(tokens)
    torch.testing.assert_close(_hf_logits(tmp_path, tmp_path / "hf", tokens), ours, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("impl, recipe", [("triton", "rowwise_with_gw_tensorwise"), ("torchao", "rowwise")])
def test_float8_blocks_with_grouped_query_attention_train_near_bf16(impl, recipe):
    """GQA's q, k and v are one Linear of unequal pieces (4 query heads, 1 key/value head): every block
    linear becomes float8 (real float8 GEMMs on the CPU; Triton's casts in its interpreter), the head
    stays, and 5 steps follow the bf16 model's losses."""
    if impl == "torchao":
        pytest.importorskip("torchao")
    from src.distributed.float8 import convert_blocks_to_float8, float8_dims
    from src.distributed.parallelize import materialize_and_init
    from src.models.llama3.model import Llama3

    args = dict(vocab_size=256, dim=64, n_layers=1, n_heads=4, n_kv_heads=1, ffn_hidden=176, tie_embeddings=True, rope_theta=10000.0)
    assert set(float8_dims(compose_config(["model=llama3_tiny", "model.n_kv_heads=1"]).model, compose_config([]).data).values()) \
        >= {64, 96, 176}  # dim, q + k + v rows (4 + 1 + 1 heads of 16), the MLP's hidden
    losses = {}
    for name in ("bf16", "fp8"):
        with torch.device("meta"):
            model = Llama3(**args)
        if name == "fp8":
            assert convert_blocks_to_float8(model, recipe, fsdp_float8_all_gather=False, impl=impl) == 5  # qkv, out, gate, up, down
            assert type(model.head) is torch.nn.Linear and model.layers[0].attn.qkv.out_features == 96
        materialize_and_init(model, torch.device("cpu"), seed=0)
        model = model.to(torch.bfloat16)
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, foreach=True)
        tokens = torch.randint(0, 256, (1, 17), generator=torch.Generator().manual_seed(0))  # one sequence: the interpreter runs a program per row cast
        losses[name] = []
        for _ in range(5):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(model(tokens[:, :-1]).float().reshape(-1, 256), tokens[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            losses[name].append(loss.item())
    assert losses["fp8"][-1] < losses["fp8"][0] - 0.3
    assert losses["fp8"] == pytest.approx(losses["bf16"], abs=0.15)


def _tampered(folder: Path, to: Path, change) -> Path:
    """A copy of a Hugging Face folder whose tensors went through `change` (a dict of name -> tensor)."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(folder, to)
    tensors = load_file(folder / "model.safetensors")
    change(tensors)
    save_file(tensors, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_tensors_that_are_not_what_config_json_says_are_refused_naming_file_and_tensor(tmp_path):
    """Full shapes and dtypes against config.json, from the files' headers, before any rank: more
    embedding rows than its vocab_size, an int8 weight, a wrong-width tensor, a cut-off file, a
    config.json that is not JSON. Each is one line naming the file and the tensor."""
    folder = _hf_checkpoint(tmp_path, TINY, "tiny")
    overrides = ["model=llama3_tiny", *[f"model.{k}={v}" for k, v in HF.model_fields(hf_config(folder)).items()]]

    def refused(at: Path) -> str:
        with pytest.raises(ConfigError) as err:
            validate(compose_config([*overrides, f"model.hf_path={at}"]), cuda_device_count=0, mps_available=False)
        assert "\n" not in str(err.value)
        return str(err.value)

    validate(compose_config([*overrides, f"model.hf_path={folder}"]), cuda_device_count=0, mps_available=False)  # the real one passes
    rows = _tampered(folder, tmp_path / "rows", lambda t: t.update({"model.embed_tokens.weight": torch.zeros(300, 64)}))
    assert refused(rows) == (f"model.hf_path={rows}: model.safetensors's model.embed_tokens.weight is (300, 64), and config.json's shape "
                             "needs (256, 64); the weights are not those of its config.json")
    int8 = _tampered(folder, tmp_path / "int8", lambda t: t.update({"model.layers.1.mlp.up_proj.weight": torch.zeros(176, 64, dtype=torch.int8)}))
    assert "model.safetensors's model.layers.1.mlp.up_proj.weight is I8, not a float: a quantized checkpoint" in refused(int8)
    wide = _tampered(folder, tmp_path / "wide", lambda t: t.update({"model.layers.0.mlp.down_proj.weight": torch.zeros(64, 170)}))
    assert "model.layers.0.mlp.down_proj.weight is (64, 170), and config.json's shape needs (64, 176)" in refused(wide)
    gone = _tampered(folder, tmp_path / "gone", lambda t: t.pop("model.norm.weight"))
    assert "no tensor model.norm.weight in the checkpoint" in refused(gone)
    cut = _tampered(folder, tmp_path / "cut", lambda t: None)
    data = (cut / "model.safetensors").read_bytes()
    (cut / "model.safetensors").write_bytes(data[: len(data) - 100])
    assert f"{cut / 'model.safetensors'}: cut off ({len(data) - 100:,} bytes where its tensors need {len(data):,})" in refused(cut)
    bad = _tampered(folder, tmp_path / "bad", lambda t: None)
    (bad / "config.json").write_text((folder / "config.json").read_text()[:30])
    assert refused(bad).startswith(f"model.hf_path={bad}: config.json is cut off or not JSON")


def test_edge_reads_the_hugging_face_folder_it_is_given_and_refuses_an_export_of_another_model(tmp_path):
    """+exp=edge with model.hf_path benchmarks those weights, not the seeded initialisation; an
    edge.weights export of another shape, or both settings at once, is refused in one line."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    from src.edge.task import _weights, reference_model

    folder = _hf_checkpoint(tmp_path, TINY, "tiny")
    overrides = ["+exp=edge", "model=llama3_tiny", *[f"model.{k}={v}" for k, v in HF.model_fields(hf_config(folder)).items()]]
    cfg = compose_config([*overrides, f"model.hf_path={folder}"])
    validate(cfg, cuda_device_count=0, mps_available=False)
    weights = _weights(cfg)
    assert weights == {"hf_path": str(folder.resolve())}
    lm = reference_model(OmegaConf.to_container(cfg.model, resolve=True), weights, max_seq=16)
    with safe_open(folder / "model.safetensors", "pt") as f:
        assert torch.equal(lm.model.embed.weight, f.get_tensor("model.embed_tokens.weight").float())
    other = tmp_path / "other.safetensors"
    save_file({k: v.contiguous() for k, v in build_model(compose_config(["model=tiny"]).model).state_dict().items()}, other)
    for extra, said in ((["model.hf_path=", f"edge.weights={other}"], f"edge.weights={other}: no "),
                        ([f"model.hf_path={folder}", f"edge.weights={other}"], "both name the weights; give one of them")):
        with pytest.raises(ConfigError) as err:
            validate(compose_config([*overrides, *extra]), cuda_device_count=0, mps_available=False)
        assert said in str(err.value) and "\n" not in str(err.value), str(err.value)
