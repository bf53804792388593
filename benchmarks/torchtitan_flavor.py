"""LLaMA 3.2 1B as a torchtitan 0.2.2 llama3 flavor, for benchmarks/torchtitan_llama.py.

torchtitan's trainer imports this module by name (`--experimental.custom_import
benchmarks.torchtitan_flavor`) before it looks its flavor up, so the flavors below join
`torchtitan.models.llama3.llama3_args`, the dict its train spec hands out, and
`--model.flavor 1B` then builds the same shape as conf/model/llama3_1b.yaml. 0.2.2 ships debugmodel,
8B, 70B and 405B only.

The shapes are plain dicts so that the bench and its test read them without torchtitan installed.
"""
from __future__ import annotations

# torchtitan sizes the SwiGLU hidden layer as multiple_of * ceil(multiplier * int(2 * 4 * dim / 3) / multiple_of):
# at dim 2048, int(1.5 * 5461) = 8191 rounds up to 8192, LLaMA 3.2 1B's MLP (its Hugging Face config
# gives intermediate_size 8192 the same way). RoPE scaling is 3.1's with factor 32 (3.2 1B's config;
# torchtitan's default is 8): it changes the frequencies only, not the speed.
FLAVORS: dict[str, dict] = {
    "1B": dict(dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, ffn_dim_multiplier=1.5, multiple_of=256,
               vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, rope_factor=32.0),
    # The same code path at a size a CPU trains in seconds (the bench's --flavor 1B_smoke): the full
    # vocabulary, so the embedding, head and loss are the 1B's.
    "1B_smoke": dict(dim=256, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim_multiplier=1.5, multiple_of=256,
                     vocab_size=128256, rope_theta=500000.0, norm_eps=1e-5, rope_factor=32.0),
}


def ffn_hidden(shape: dict) -> int:
    """torchtitan 0.2.2's FeedForward rule (models/llama3/model/model.py) for a flavor's hidden size."""
    hidden = int(2 * 4 * shape["dim"] / 3)
    if shape.get("ffn_dim_multiplier") is not None:
        hidden = int(shape["ffn_dim_multiplier"] * hidden)
    m = shape["multiple_of"]
    return m * ((hidden + m - 1) // m)


def param_count(shape: dict, tied: bool = False) -> int:
    """Parameters of the flavor's model, norms included; torchtitan's llama3 keeps the head apart from
    the embedding (tied=False)."""
    d, hd = shape["dim"], shape["dim"] // shape["n_heads"]
    attn = d * hd * (2 * shape["n_heads"] + 2 * shape["n_kv_heads"])  # wq, wo; wk, wv
    block = attn + 3 * d * ffn_hidden(shape) + 2 * d  # + the two RMSNorm weights
    embed = shape["vocab_size"] * d
    return shape["n_layers"] * block + d + embed * (1 if tied else 2)


def flops_per_token(shape: dict, seq_len: int, tied: bool = False) -> float:
    """This project's count (src/models/llama3/model.py): 6 x the parameters a token multiplies, the head
    included, plus attention's 12 x layers x heads x head_dim x seq_len. For an untied model it equals
    torchtitan's (6 x non-embedding parameters + 6 x layers x heads x 2 head_dim x seq_len)."""
    matmul = param_count(shape, tied) - shape["vocab_size"] * shape["dim"] * (0 if tied else 1)
    hd = shape["dim"] // shape["n_heads"]
    return 6 * matmul + 12 * shape["n_layers"] * shape["n_heads"] * hd * seq_len


def register() -> None:
    """Add FLAVORS to torchtitan's llama3 registry (torchtitan must be importable)."""
    from torchtitan.models.llama3 import TransformerModelArgs, llama3_args
    from torchtitan.models.llama3.model.args import RoPEScalingArgs

    for name, s in FLAVORS.items():
        llama3_args[name] = TransformerModelArgs(
            dim=s["dim"], n_layers=s["n_layers"], n_heads=s["n_heads"], n_kv_heads=s["n_kv_heads"],
            ffn_dim_multiplier=s["ffn_dim_multiplier"], multiple_of=s["multiple_of"], vocab_size=s["vocab_size"],
            rope_theta=s["rope_theta"], norm_eps=s["norm_eps"],
            rope_scaling_args=RoPEScalingArgs(scaling_factor=s["rope_factor"]))


try:  # imported by torchtitan's trainer: register; imported by the bench or a test without torchtitan: nothing
    import torchtitan.models.llama3  # noqa: F401
except ImportError:
    pass
else:
    register()
