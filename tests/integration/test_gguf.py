"""`python -m src.export --gguf`: a trained model=llama3_tiny checkpoint as llama.cpp's GGUF file
(src/edge/gguf_file.py), read back by the `gguf` package's reader. The tensors are the checkpoint's
(fp16 exactly, Q8_0 and Q4_0 within their blocks' rounding), and a forward pass written the way
llama.cpp's `llama` graph computes it (pairwise RoPE with the rope_freqs factors, grouped-query
attention) over the file's tensors gives our model's logits: so the q/k permutation and the RoPE
scaling are what llama.cpp reads, not only well-formed bytes."""
from __future__ import annotations

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")  # pip install -e ".[test]"

from src.config.compose import compose_config  # noqa: E402
from src.export import main as export  # noqa: E402
from src.models import build_model  # noqa: E402
from src.models.llama3.hf import HF  # noqa: E402

TINY = ["model=llama3_tiny", "dist.nproc=1", "precision=fp32", "train.steps=2", "data.seq_len=32", "data.batch_size=2",
        "tracking=none", "train.progress=false", "checkpoint.enabled=true"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """(checkpoint step folder, its config, the model with its weights, its Hugging Face tensors)."""
    from safetensors.torch import load_file

    from src.runtime import RunContext
    from src.train.worker import train

    tmp = tmp_path_factory.mktemp("gguf")
    run_dir = tmp / "run"
    run_dir.mkdir()
    cfg = compose_config(TINY)
    train(cfg, RunContext(run_dir=str(run_dir), cwd=str(tmp)))
    step = run_dir / "checkpoints" / "step_00000002"
    assert export([str(step), "--hf", "--out", str(tmp / "hf")]) == 0
    model = build_model(cfg.model)
    HF.load(model, tmp / "hf")
    hf = {k: v.float().numpy() for k, v in load_file(tmp / "hf" / "model.safetensors").items()}
    return step, cfg, model.eval(), hf


def _field(reader, key: str):
    return reader.fields[key].contents()


def _tensors(reader) -> dict[str, np.ndarray]:
    return {t.name: gguf.quants.dequantize(t.data, t.tensor_type).reshape([int(n) for n in reversed(t.shape)]).astype(np.float32)
            for t in reader.tensors}


def _unpermute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """llama.cpp's pairwise q/k rows back to Hugging Face's rotate-half order."""
    return w.reshape(n_heads, w.shape[0] // n_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _rms(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w


def llama_cpp_logits(reader, tokens: np.ndarray) -> np.ndarray:
    """(T, vocab) logits of one sequence, computed as llama.cpp's `llama` graph does from the file."""
    t = _tensors(reader)
    n_heads, n_kv = _field(reader, "llama.attention.head_count"), _field(reader, "llama.attention.head_count_kv")
    eps, base = _field(reader, "llama.attention.layer_norm_rms_epsilon"), _field(reader, "llama.rope.freq_base")
    dim = _field(reader, "llama.embedding_length")
    hd = dim // n_heads
    factors = t.get("rope_freqs.weight", np.ones(hd // 2, np.float32))
    pos = np.arange(len(tokens))[:, None]
    angle = pos * base ** (-np.arange(0, hd, 2) / hd) / factors  # (T, hd/2)
    cos, sin = np.cos(angle)[:, None, :], np.sin(angle)[:, None, :]

    def rope(x):  # (T, heads, hd), pairs (2i, 2i + 1)
        a, b = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = a * cos - b * sin, a * sin + b * cos
        return out

    x = t["token_embd.weight"][tokens]
    T = len(tokens)
    mask = np.triu(np.full((T, T), -np.inf), 1)
    for i in range(_field(reader, "llama.block_count")):
        b = f"blk.{i}."
        h = _rms(x, t[b + "attn_norm.weight"], eps)
        q = rope((h @ t[b + "attn_q.weight"].T).reshape(T, n_heads, hd))
        k = rope((h @ t[b + "attn_k.weight"].T).reshape(T, n_kv, hd))
        v = (h @ t[b + "attn_v.weight"].T).reshape(T, n_kv, hd)
        group = n_heads // n_kv
        k, v = np.repeat(k, group, axis=1), np.repeat(v, group, axis=1)
        scores = np.einsum("thd,shd->hts", q, k) / np.sqrt(hd) + mask
        p = np.exp(scores - scores.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        x = x + np.einsum("hts,shd->thd", p, v).reshape(T, n_heads * hd) @ t[b + "attn_output.weight"].T
        h = _rms(x, t[b + "ffn_norm.weight"], eps)
        gate = h @ t[b + "ffn_gate.weight"].T
        x = x + (gate / (1 + np.exp(-gate)) * (h @ t[b + "ffn_up.weight"].T)) @ t[b + "ffn_down.weight"].T
    x = _rms(x, t["output_norm.weight"], eps)
    return x @ t.get("output.weight", t["token_embd.weight"]).T


def test_the_f16_file_computes_our_models_logits_the_way_llama_cpp_reads_it(trained, tmp_path):
    step, cfg, model, _ = trained
    out = tmp_path / "tiny-f16.gguf"
    assert export([str(step), "--gguf", "f16", "--out", str(out)]) == 0
    reader = gguf.GGUFReader(out)
    assert _field(reader, "general.architecture") == "llama"
    assert "rope_freqs.weight" in {t.name for t in reader.tensors}  # llama3_tiny has LLaMA 3.1's RoPE scaling
    # our model with its weights rounded to fp16 as the file holds them (norms stay fp32 in both)
    rounded = build_model(cfg.model)
    rounded.load_state_dict({k: v.half().float() if v.dim() == 2 else v for k, v in model.state_dict().items()})
    tokens = torch.randint(0, 256, (24,), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ours = rounded.eval()(tokens[None])[0].numpy()
    np.testing.assert_allclose(llama_cpp_logits(reader, tokens.numpy()), ours, rtol=1e-4, atol=1e-4)


# the largest error a block's value may carry, as a fraction of the block's max |w|: Q8_0 half its step
# of max / 127 (and the fp16 scale's own rounding, times up to 127); Q4_0 a whole step of max / 8, since
# the max's sign takes -8 and the other sign stops at +7
@pytest.mark.parametrize("qtype, error_of_max", [("f16", None), ("q8_0", 0.6 / 127), ("q4_0", 1.05 / 8)])
def test_the_file_read_back_holds_the_checkpoints_tensors(trained, tmp_path, qtype, error_of_max):
    """Every tensor of the Hugging Face folder is in the file under llama.cpp's name: the blocks'
    linears in `qtype` where their rows tile into blocks of 32 (ffn_down's 176 inputs do not: fp16),
    the embedding fp16, norms fp32; each value within its type's rounding of the checkpoint's."""
    step, cfg, _, hf = trained
    out = tmp_path / f"tiny-{qtype}.gguf"
    assert export([str(step), "--gguf", qtype, "--out", str(out)]) == 0
    reader = gguf.GGUFReader(out)
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    got = _tensors(reader)
    n_heads, n_kv = cfg.model.n_heads, cfg.model.n_kv_heads
    assert len(got) == len(hf) + 1  # and rope_freqs
    want_type = qtype.upper()
    for i in range(cfg.model.n_layers):
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up"):
            assert types[f"blk.{i}.{name}.weight"] == want_type
        assert types[f"blk.{i}.ffn_down.weight"] == "F16"
        assert types[f"blk.{i}.attn_norm.weight"] == "F32"
    assert types["token_embd.weight"] == "F16" and "output.weight" not in types  # tied: the head is the embedding
    from src.edge.gguf_file import _gguf_name

    for hf_name, want in hf.items():
        name = _gguf_name(hf_name)
        have = got[name]
        if name.endswith("attn_q.weight"):
            have = _unpermute(have, n_heads)
        elif name.endswith("attn_k.weight"):
            have = _unpermute(have, n_kv)
        assert have.shape == want.shape, name
        if types[name] in ("F32",):
            np.testing.assert_array_equal(have, want, err_msg=name)
        elif types[name] == "F16":
            np.testing.assert_array_equal(have, want.astype(np.float16).astype(np.float32), err_msg=name)
        else:  # a block of 32 along a row shares one fp16 scale
            blocks = np.abs(want.reshape(want.shape[0], -1, 32)).max(-1, keepdims=True)
            bound = np.broadcast_to(blocks * error_of_max + 1e-7, blocks.shape[:-1] + (32,)).reshape(want.shape)
            assert (np.abs(have - want) <= bound).all(), name


def test_wrong_asks_are_refused_in_one_line(trained, tmp_path, capsys):
    step, *_ = trained
    with pytest.raises(SystemExit) as ended:
        export([str(step), "--gguf", "q5_k"])
    assert ended.value.code == 2 and "invalid choice: 'q5_k'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        export([str(step), "--gguf", "f16", "--hf"])
    assert "give one" in capsys.readouterr().err
    from src.edge.gguf_file import GGUFError, write_gguf

    (tmp_path / "gpt2").mkdir()
    (tmp_path / "gpt2" / "config.json").write_text('{"architectures": ["GPT2LMHeadModel"]}')
    with pytest.raises(GGUFError, match=r"a GPT2LMHeadModel, and this writer knows .*LlamaForCausalLM"):
        write_gguf(tmp_path / "gpt2", tmp_path / "x.gguf")
    assert not (tmp_path / "x.gguf").exists()
