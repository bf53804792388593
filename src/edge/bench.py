"""Time greedy generation (prefill, then one decode call per token) on any runner, and check its
logits against the fp32 torch reference on the CPU, fed the same tokens.

Per job: first-run latency (the first prefill: pipeline creation, first dispatch), time to first
token (the prefill, p50/p90 over the timed generations), decode step latency (p50/p90 over every
decode call of every timed generation), prefill and decode tokens/s (batch x tokens / p50), and
the largest relative error over the prefill and decode logits (max |a - b| / max |b| per step).
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from src.edge.model import EdgeLM


@dataclass
class Generation:
    logits: list[np.ndarray]
    fed: list[np.ndarray]
    """the token fed to each decode call (the argmax of the step before)"""
    prefill_ms: float
    decode_ms: list[float] = field(default_factory=list)


def generate(runner: Any, tokens: np.ndarray, steps: int) -> Generation:
    t0 = time.perf_counter()
    logits, state = runner.prefill(tokens)
    gen = Generation([logits], [], 1e3 * (time.perf_counter() - t0))
    for i in range(steps):
        nxt = logits.argmax(-1).astype(np.int32).reshape(-1, 1)
        t0 = time.perf_counter()
        logits, state = runner.decode(nxt, tokens.shape[1] + i, state)
        gen.decode_ms.append(1e3 * (time.perf_counter() - t0))
        gen.logits.append(logits)
        gen.fed.append(nxt)
    return gen


@torch.no_grad()
def reference_logits(lm: EdgeLM, tokens: np.ndarray, fed: list[np.ndarray]) -> list[np.ndarray]:
    """fp32 torch on the CPU, teacher-forced with the tokens the runner chose, so a runner whose
    argmax differs in one step is still compared step for step."""
    logits, k, v = lm.prefill(torch.from_numpy(tokens))
    out = [logits.numpy()]
    for i, nxt in enumerate(fed):
        logits, k, v = lm.decode(torch.from_numpy(nxt), torch.tensor([tokens.shape[1] + i]), k, v)
        out.append(logits.numpy())
    return out


def relative_errors(got: list[np.ndarray], want: list[np.ndarray]) -> list[float]:
    return [float(np.abs(g.astype(np.float64) - w).max() / max(np.abs(w).max(), 1e-30)) for g, w in zip(got, want)]


def _pct(values: list[float], q: float) -> float:
    return float(np.percentile(values, q)) if values else float("nan")


def measure(runner: Any, reference: EdgeLM, tokens: np.ndarray, steps: int, warmup: int, repeats: int) -> dict[str, Any]:
    first = generate(runner, tokens, steps)
    errors = relative_errors(first.logits, reference_logits(reference, tokens, first.fed))
    for _ in range(warmup):
        generate(runner, tokens, steps)
    timed = [generate(runner, tokens, steps) for _ in range(repeats)]
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
        "rel_err": max(errors), "rel_err_prefill": errors[0], "rel_err_per_step": errors,
        "generated": np.concatenate(first.fed, axis=1).tolist() if first.fed else [],
    }
