"""What weight-only quantization (edge.quant) alone costs in accuracy, in torch fp32 on the CPU: the
logits' largest relative error against the unquantized model, teacher-forced over a prompt and
greedy decode steps, and the greedy tokens' agreement with the unquantized model's own generation.
The tolerances of src/edge/bench.py TOLERANCE come from these figures (a device's module adds only
its dtype's error on top: rel_err_vs_quantized).

    python -m benchmarks.edge_quant_error --models tiny,small --steps 64 --groups 32,128
"""
from __future__ import annotations

import argparse
import copy

import numpy as np

from src.edge.bench import agreement, reference_logits, relative_errors, torch_greedy
from src.edge.quant import quantized_copy
from src.edge.task import quant_setting, reference_model


def model_config(name: str) -> dict:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    return OmegaConf.to_container(compose_config([f"model={name}"]).model, resolve=True)


def quant_error(model: str, fmt: str, group: int, prompt: int, steps: int, batch: int, seed: int) -> dict:
    cfg = model_config(model)
    ref = reference_model(cfg, {"seed": 0}, prompt + steps, batch)
    tokens = np.random.default_rng(seed).integers(0, cfg["vocab_size"], (batch, prompt)).astype(np.int32)
    want_tokens = torch_greedy(copy.deepcopy(ref), tokens, steps)
    quantized = quantized_copy(ref, quant_setting(fmt, group))
    got_tokens = torch_greedy(copy.deepcopy(quantized), tokens, steps)
    fed = got_tokens[:-1]  # both fed the quantized model's own tokens: step for step on one context
    errors = relative_errors(reference_logits(quantized, tokens, fed), reference_logits(copy.deepcopy(ref), tokens, fed))
    share, same_steps = agreement(got_tokens, want_tokens)
    return {"model": model, "quant": fmt, "group": group if fmt == "int4" else None, "rel_err": max(errors),
            "token_agreement": share, "same_tokens_steps": same_steps, "steps": steps + 1}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="tiny,small")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=32)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--groups", default="32", help="int4 group sizes, comma-separated")
    parser.add_argument("--seeds", default="0", help="prompts (numpy seeds), comma-separated")
    args = parser.parse_args(argv)
    print("| model | quant | group | prompt seed | max rel err | token agreement | same tokens from the start |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for model in args.models.split(","):
        runs = [("int8", 0)] + [("int4", int(g)) for g in args.groups.split(",")]
        for fmt, group in runs:
            for seed in (int(s) for s in args.seeds.split(",")):
                r = quant_error(model, fmt, group, args.prompt, args.steps, args.batch, seed)
                print(f"| {model} | {fmt} | {r['group'] or '-'} | {seed} | {r['rel_err']:.3g} | {r['token_agreement']:.2f} | "
                      f"{r['same_tokens_steps']}/{r['steps']} |", flush=True)


if __name__ == "__main__":
    main()
