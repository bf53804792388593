"""GGUF, llama.cpp's file, from a Hugging Face folder of a family llama.cpp runs (what `python -m
src.export --hf` writes, or transformers' own; each architecture's config names its llama.cpp
architecture, GGUF_ARCHS in src/models/ARCH/config.py): so the weights this project deploys through
IREE run in llama.cpp too, and the two are compared on the same weights
(benchmarks/edge_vs_llama_cpp.py).

The names and layouts are llama.cpp's convert_hf_to_gguf.py's: `blk.N.attn_q` and so on; for its
`llama` architecture the q and k rows are permuted from Hugging Face's rotate-half order to the
pairwise order its RoPE reads (the others here use the rotate-half one, NEOX in llama.cpp's words,
so theirs stay); LLaMA 3.1's RoPE scaling written as the `rope_freqs` factors. The `gguf` package writes the file
and quantizes (Q8_0, Q4_0: blocks of 32 along a row, one fp16 scale each).

What is quantized matches the edge modules' `edge.quant` (src/edge/quant.py): the blocks' linear
weights; the embedding and the head stay fp16, the norms and biases fp32. A row whose length is not
a multiple of the block stays fp16, as convert_hf_to_gguf.py leaves it.

The vocabulary is this project's bytes: a token per byte value (`<0x00>` .. `<0xFF>`, llama.cpp's
byte tokens), the rest unused; llama.cpp is then fed token ids, never text, so its tokenizer
plays no part in a comparison.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np

TYPES = ("f16", "q8_0", "q4_0")
"""the tensor types `--gguf` writes the blocks' linear weights in"""
PAIRWISE_ROPE = ("llama",)
"""llama.cpp's architectures whose RoPE rotates (2i, 2i + 1) pairs: their q and k rows are permuted"""


def gguf_archs() -> dict[str, str]:
    """config.json's architecture -> llama.cpp's, as the architectures' configs declare them."""
    from src.models.config import arch_configs

    return {hf: gguf for schema in arch_configs().values() for hf, gguf in schema.GGUF_ARCHS.items()}

# Hugging Face's names inside a block -> llama.cpp's
BLOCK = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.q_proj": "attn_q",
         "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output",
         "self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate",
         "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
LINEARS = {"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"}
"""the block weights that take the file's type (the rest of a block is fp32)"""


class GGUFError(ValueError):
    """A folder this writer cannot convert: one line naming what and the way out."""


def llama_permute(w: np.ndarray, n_heads: int) -> np.ndarray:
    """q or k rows from rotate-half order (each head's first half pairs with its second) to the
    interleaved order (row 2i pairs with 2i + 1) that llama.cpp's `llama` RoPE reads."""
    return w.reshape(n_heads, 2, w.shape[0] // n_heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def llama3_rope_factors(config: dict) -> np.ndarray | None:
    """LLaMA 3.1's RoPE scaling as the per-frequency divisors llama.cpp reads (`rope_freqs`), or None
    where the config has no llama3 scaling."""
    scaling = config.get("rope_scaling") or {}
    if scaling.get("rope_type", scaling.get("type")) != "llama3":
        return None
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    factor, low, high = scaling["factor"], scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    original = scaling.get("original_max_position_embeddings", 8192)
    low_wavelen, high_wavelen = original / low, original / high
    factors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * math.pi * config.get("rope_theta", 10000.0) ** (i / head_dim)
        if wavelen < high_wavelen:
            factors.append(1.0)
        elif wavelen > low_wavelen:
            factors.append(factor)
        else:
            smooth = (original / wavelen - low) / (high - low)
            factors.append(1 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def _tensors(folder: Path) -> dict[str, np.ndarray]:
    """Every tensor of the folder's safetensors files, as fp32 numpy arrays (bf16 has no numpy dtype)."""
    from safetensors.torch import load_file

    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise GGUFError(f"{folder}: no *.safetensors there; write the folder with `python -m src.export CHECKPOINT --hf`")
    out: dict[str, np.ndarray] = {}
    for f in files:
        out.update({k: v.float().numpy() for k, v in load_file(f).items()})
    return out


def _gguf_name(hf: str) -> str | None:
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")
    if parts[:2] != ["model", "layers"] or len(parts) < 5:
        return None
    inner, kind = ".".join(parts[3:-1]), parts[-1]
    return f"blk.{parts[2]}.{BLOCK[inner]}.{kind}" if inner in BLOCK else None


def write_gguf(folder: Path, out: Path, qtype: str = "f16") -> None:
    """The Hugging Face folder `folder` as one GGUF file `out`, the blocks' linears in `qtype`."""
    import gguf

    if qtype not in TYPES:
        raise GGUFError(f"--gguf {qtype}: not a type this writer makes; use one of {', '.join(TYPES)}")
    config_path = folder / "config.json"
    if not config_path.is_file():
        raise GGUFError(f"{folder}: no config.json there; give a Hugging Face folder (`python -m src.export CHECKPOINT --hf`)")
    config = json.loads(config_path.read_text())
    names = config.get("architectures") or ["?"]
    known = gguf_archs()
    arch = known.get(names[0])
    if arch is None:
        raise GGUFError(f"{folder}: a {names[0]}, and this writer knows {', '.join(known)}")
    n_heads, n_kv = config["num_attention_heads"], config.get("num_key_value_heads", config["num_attention_heads"])
    head_dim = config.get("head_dim") or config["hidden_size"] // n_heads
    ggml = gguf.GGMLQuantizationType
    block_type, file_type = ggml[qtype.upper()], gguf.LlamaFileType[f"MOSTLY_{qtype.upper()}"]  # TYPES are ggml's names, lower case

    tensors = _tensors(folder)
    writer = gguf.GGUFWriter(str(out), arch)
    writer.add_name(folder.name)
    writer.add_context_length(int(config.get("max_position_embeddings", 2048)))
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_heads)
    writer.add_head_count_kv(n_kv)
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(file_type)
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_byte_vocab(writer, config["vocab_size"])

    def add(name: str, data: np.ndarray, kind) -> None:
        if kind in (ggml.Q8_0, ggml.Q4_0):
            block = gguf.GGML_QUANT_SIZES[kind][0]
            if data.shape[-1] % block:
                kind = ggml.F16  # as convert_hf_to_gguf.py: a row the blocks do not tile stays fp16
            else:
                writer.add_tensor(name, gguf.quants.quantize(data, kind), raw_dtype=kind)
                return
        writer.add_tensor(name, data.astype(np.float16 if kind == ggml.F16 else np.float32))

    pairwise = arch in PAIRWISE_ROPE
    factors = llama3_rope_factors(config) if pairwise else None
    if factors is not None:
        add("rope_freqs.weight", factors, ggml.F32)
    for hf_name, data in tensors.items():
        name = _gguf_name(hf_name)
        if name is None:
            raise GGUFError(f"{folder}: tensor {hf_name} has no llama.cpp name in this writer; a {names[0]} has no such tensor")
        stem = name.rsplit(".", 1)[0].split(".")[-1]
        if pairwise and stem in ("attn_q", "attn_k") and name.endswith(".weight"):
            data = llama_permute(data, n_heads if stem == "attn_q" else n_kv)
        if name in ("token_embd.weight", "output.weight"):
            kind = ggml.F16
        elif stem in LINEARS and name.endswith(".weight"):
            kind = block_type
        else:
            kind = ggml.F32
        add(name, data, kind)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _add_byte_vocab(writer, vocab_size: int) -> None:
    """A token per byte value, as llama.cpp's byte tokens, then unused ones up to the model's vocab."""
    import gguf

    tokens = [f"<0x{b:02X}>" for b in range(min(256, vocab_size))] + [f"<unused{i}>" for i in range(max(0, vocab_size - 256))]
    types = [gguf.TokenType.BYTE] * min(256, vocab_size) + [gguf.TokenType.UNUSED] * max(0, vocab_size - 256)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(tokens)
    writer.add_token_scores([0.0] * vocab_size)
    writer.add_token_types(types)
    writer.add_add_bos_token(False)
    writer.add_add_eos_token(False)
