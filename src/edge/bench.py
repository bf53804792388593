"""Time greedy generation (prefill, then one decode call per token) on any runner, and check its
logits against the fp32 torch reference on the CPU, fed the same tokens.

Per job: first-run latency (the first prefill: pipeline creation, first dispatch), time to first
token (the prefill until its greedy token is on the host, p50/p90 over the timed generations),
decode step latency (one call until its token is on the host, p50/p90 over every decode call of
every timed generation), prefill and decode tokens/s (batch x tokens / p50), the largest relative
error over the prefill and decode logits (max |a - b| / max |b| per step), and how many of the
tokens chosen on the device differ from the argmax of the reference's logits. Timed generations
never read the logits: a step is the runner's decode_token (no logits result allocated) and moves
one int32 per sequence to the host. And the step split in two
(`split_step`): the decode call alone and the read of its token, so per-step overhead shows apart.
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from src.edge.model import EdgeLM

# Largest relative error of the logits against fp32 torch on the CPU that still counts as right,
# per format: the dtype an unquantized module computes in, or the weights' quantization
# (edge.quant, src/edge/quant.py), which bounds a quantized module of any dtype against the
# unquantized fp32 model.
# fp32: other summation orders, 1e-6 measured on lavapipe; 1e-3 leaves room for GPU reductions.
# fp16: every activation rounded to 11 bits, 1.1e-3 measured on lavapipe (tiny, 2 blocks); 3e-2
# still fails the adreno-compiled module on lavapipe (1.09 in issue 13, 2.0 now) 30-60 times over.
# int8 (per output channel) and int4 (groups of 32 to 128): about 2x the quantization's own largest
# error in torch fp32, prefill + 64 greedy steps of 32-token prompts (3 seeds): int8 0.012 on tiny,
# 0.024 on small; int4 g32 0.14 / 0.27, g64 0.19 / 0.33 (`python -m benchmarks.edge_quant_error
# --groups 32,64 --seeds 0,1,2`). A wrong scale or a transposed weight is 0.5-2. The seeded models'
# logits are nearly flat (a random initialisation), so int4's 15 levels a group move them by a
# quarter of their largest value; their greedy tokens part from fp32's within 1-10 steps (small:
# 0-1 of 65), int8's within 8-65: reported (token_agreement, same_tokens_steps), not bounded; what
# is bounded is a module against torch in its own format (tests/system/test_edge_quant.py: every token).
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 1e-1, "int8": 5e-2, "int4": 5e-1}


def tolerance(dtype: str, quant: str = "none") -> float:
    """The limit of the logits' relative error against unquantized fp32 torch: the dtype's for an
    unquantized module, else the larger of the dtype's and the quantization's."""
    return TOLERANCE[dtype] if quant == "none" else max(TOLERANCE[dtype], TOLERANCE[quant])


@dataclass
class Generation:
    tokens: list[np.ndarray]
    """the greedy token of the prefill and of each decode call, (B,) each"""
    prefill_ms: float
    decode_ms: list[float] = field(default_factory=list)
    logits: list[np.ndarray] = field(default_factory=list)


def generate(runner: Any, tokens: np.ndarray, steps: int, check: bool = False) -> Generation:
    """Greedy generation; with `check`, the logits of every call read back as well (untimed)."""
    t0 = time.perf_counter()
    if check:
        token, logits = runner.prefill(tokens)
    else:  # the timed path: no logits result
        token = runner.prefill_token(tokens)
    gen = Generation([runner.tokens(token)], 1e3 * (time.perf_counter() - t0))
    if check:
        gen.logits.append(runner.logits(logits))
    for i in range(steps):
        t0 = time.perf_counter()
        if check:
            token, logits = runner.decode(token, tokens.shape[1] + i)  # the device's token, not the host's copy
        else:
            token = runner.decode_token(token, tokens.shape[1] + i)
        gen.tokens.append(runner.tokens(token))
        gen.decode_ms.append(1e3 * (time.perf_counter() - t0))
        if check:
            gen.logits.append(runner.logits(logits))
    return gen


@torch.no_grad()
def reference_logits(lm: EdgeLM, tokens: np.ndarray, fed: list[np.ndarray]) -> list[np.ndarray]:
    """fp32 torch (on the CPU, or where `lm` lives), teacher-forced with the tokens the runner chose,
    so a runner whose argmax differs in one step is still compared step for step."""
    lm.resize_cache(tokens.shape[0])
    dev = lm.k_cache.device
    _, logits = lm.prefill(torch.from_numpy(tokens).to(dev))
    out = [logits.cpu().numpy()]
    for i, nxt in enumerate(fed):
        _, logits = lm.decode(torch.from_numpy(nxt.astype(np.int32)).to(dev), torch.tensor([tokens.shape[1] + i], dtype=torch.int32, device=dev))
        out.append(logits.cpu().numpy())
    return out


@torch.no_grad()
def torch_greedy(lm: EdgeLM, tokens: np.ndarray, steps: int) -> list[np.ndarray]:
    """fp32 torch's own greedy generation (each step fed its own token): the prefill's token and
    each decode step's, (B,) each."""
    lm.resize_cache(tokens.shape[0])
    dev = lm.k_cache.device
    token, _ = lm.prefill(torch.from_numpy(tokens).to(dev))
    out = [token.cpu().numpy()]
    for i in range(steps):
        token, _ = lm.decode(token, torch.tensor([tokens.shape[1] + i], dtype=torch.int32, device=dev))
        out.append(token.cpu().numpy())
    return out


def agreement(got: list[np.ndarray], want: list[np.ndarray]) -> tuple[float, int]:
    """(share of the tokens equal to `want`'s at the same step and sequence, steps from the start
    on which every sequence's token equals `want`'s): after the first difference the two
    generations read different contexts, so the second is the one that says how far they go alike."""
    same = np.stack(got) == np.stack(want)  # (steps + 1, B)
    whole = same.all(axis=1)
    return float(same.mean()), int(len(whole) if whole.all() else np.argmin(whole))


def relative_errors(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    return [float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want)]


def split_step(runner: Any, tokens: np.ndarray, steps: int, reads: int = 10) -> tuple[float, float]:
    """A decode step in its two parts, p50 ms each: the call alone, its token left on the device
    (IREE's calls return when the device is done; torch's when the kernels are queued), and one
    read of a token already computed (a copy to the host and a wait: the host round trip)."""
    token, _ = runner.prefill(tokens)
    calls = []
    for i in range(steps):
        t0 = time.perf_counter()
        token = runner.decode_token(token, tokens.shape[1] + i)
        calls.append(1e3 * (time.perf_counter() - t0))
    runner.tokens(token)  # the device idle: each read below is the round trip alone
    read = []
    for _ in range(reads):
        t0 = time.perf_counter()
        runner.tokens(token)
        read.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(calls), statistics.median(read)


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def measure(runner: Any, reference: EdgeLM, tokens: np.ndarray, steps: int, warmup: int, repeats: int,
            quantized: EdgeLM | None = None) -> dict[str, Any]:
    """The figures above; `quantized`: the reference with the module's quantized weights (fp32),
    for the error of the module's own arithmetic apart from the quantization's."""
    first = generate(runner, tokens, steps, check=True)
    want = reference_logits(reference, tokens, first.tokens[:-1])
    errors = relative_errors(first.logits, want)
    mismatches = sum(int((t != w.argmax(-1)).sum()) for t, w in zip(first.tokens, want))
    share, same_steps = agreement(first.tokens, torch_greedy(reference, tokens, steps))
    figures: dict[str, Any] = {"token_agreement": share, "same_tokens_steps": same_steps}
    if quantized is not None:
        # fed the same tokens: the dtype's tolerance applies (the device computes what was quantized)
        figures["rel_err_vs_quantized"] = max(relative_errors(first.logits, reference_logits(quantized, tokens, first.tokens[:-1])))
    for _ in range(warmup):
        generate(runner, tokens, steps)
    timed = [generate(runner, tokens, steps) for _ in range(repeats)]
    call_ms, read_ms = split_step(runner, tokens, steps)
    prefill = [g.prefill_ms for g in timed]
    decode = [t for g in timed for t in g.decode_ms]
    batch, prompt = tokens.shape
    ttft = statistics.median(prefill)
    step = statistics.median(decode) if decode else float("nan")
    return {
        "first_run_ms": first.prefill_ms,
        "ttft_p50_ms": ttft, "ttft_p90_ms": _pct(prefill, 90),
        "decode_p50_ms": step, "decode_p90_ms": _pct(decode, 90),
        "prefill_tokens_per_s": batch * prompt / (ttft / 1e3),
        "decode_tokens_per_s": batch / (step / 1e3) if decode else None,
        "decode_call_ms": call_ms, "token_read_ms": read_ms,
        "rel_err": max(errors), "rel_err_prefill": errors[0], "rel_err_per_step": errors,
        "greedy_mismatches": mismatches,
        # against torch fp32's own generation (not fed the runner's tokens): the share of equal
        # tokens, and how many steps (the prefill's token the first) all sequences stay equal
        **figures,
        # the timed steps' tokens against the checked pass's: the timed path (decode_token or
        # decode_token_into, read from another buffer) must generate the same sequence
        "timed_token_mismatches": sum(int((np.stack(g.tokens) != np.stack(first.tokens)).sum()) for g in timed),
        "generated": np.stack(first.tokens, axis=1).tolist(),
    }


def tolerance_error(summary: dict[str, Any]) -> str | None:
    """The one line that fails a run whose logits are further from torch than its format allows
    (a quantized module: also further from the quantized torch model than its dtype allows)."""
    dtype, quant = summary["dtype"], summary.get("quant") or "none"
    limit = tolerance(dtype, quant)
    name = dtype if quant == "none" else f"{dtype} {quant}"
    head = f"{summary['backend']} {summary.get('target') or ''} {name}: max relative error"
    if not summary["rel_err"] <= limit:  # NaN compares False: fails too
        return (f"{head} {summary['rel_err']:.3g} against torch fp32 exceeds the {quant if quant != 'none' else dtype} tolerance {limit:g}; "
                f"the numbers are wrong, not slow")
    own = summary.get("rel_err_vs_quantized")
    if own is not None and not own <= TOLERANCE[dtype]:
        return (f"{head} {own:.3g} against torch fp32 with the same {quant} weights exceeds the {dtype} tolerance {TOLERANCE[dtype]:g}; "
                f"the module's dequantization is wrong, not the quantization")
    return None
