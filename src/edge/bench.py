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

# Largest relative error of the logits against fp32 torch on the CPU that still counts as right.
# fp32: other summation orders, 1e-6 measured on lavapipe; 1e-3 leaves room for GPU reductions.
# fp16: every activation rounded to 11 bits, 1.1e-3 measured on lavapipe (tiny, 2 blocks); 3e-2
# still fails the adreno-compiled module on lavapipe (1.09 in issue 13, 2.0 now) 30-60 times over.
TOLERANCE = {"fp32": 1e-3, "fp16": 3e-2, "bf16": 1e-1}


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
    token, logits = runner.prefill(tokens)
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
    """fp32 torch on the CPU, teacher-forced with the tokens the runner chose, so a runner whose
    argmax differs in one step is still compared step for step."""
    lm.resize_cache(tokens.shape[0])
    _, logits = lm.prefill(torch.from_numpy(tokens))
    out = [logits.numpy()]
    for i, nxt in enumerate(fed):
        _, logits = lm.decode(torch.from_numpy(nxt.astype(np.int32)), torch.tensor([tokens.shape[1] + i], dtype=torch.int32))
        out.append(logits.numpy())
    return out


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


def measure(runner: Any, reference: EdgeLM, tokens: np.ndarray, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    first = generate(runner, tokens, steps, check=True)
    want = reference_logits(reference, tokens, first.tokens[:-1])
    errors = relative_errors(first.logits, want)
    mismatches = sum(int((t != w.argmax(-1)).sum()) for t, w in zip(first.tokens, want))
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
        # the timed steps' tokens against the checked pass's: the timed path (decode_token or
        # decode_token_into, read from another buffer) must generate the same sequence
        "timed_token_mismatches": sum(int((np.stack(g.tokens) != np.stack(first.tokens)).sum()) for g in timed),
        "generated": np.stack(first.tokens, axis=1).tolist(),
    }


def tolerance_error(summary: dict[str, Any]) -> str | None:
    """The one line that fails a run whose logits are further from torch than its dtype allows."""
    limit = TOLERANCE[summary["dtype"]]
    if summary["rel_err"] <= limit:  # NaN compares False: fails too
        return None
    return (f"{summary['backend']} {summary.get('target') or ''} {summary['dtype']}: max relative error {summary['rel_err']:.3g} "
            f"against torch fp32 exceeds the {summary['dtype']} tolerance {limit:g}; the numbers are wrong, not slow")
