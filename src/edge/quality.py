"""Quality as the edge world reports it: perplexity on held-out text, computed through the module as
deployed (IREE on the device, or torch off IREE) and through torch fp32, so a quantization's cost is
a perplexity increase on a trained model, not greedy agreement on random weights (whose logits are
nearly flat, so any rounding flips the argmax).

The text is held out from training: the Python standard library's sources after those the training
corpus reads (src/data/batches.py reads them in sorted order up to data.corpus_mb), as bytes, which
is what a model trained on data=text predicts. Teacher-forced over the module's own calls: the
prefill of the first prompt_len bytes gives the next byte's logits, then each decode call is fed
the true byte and gives the following one's, decode_steps of them: prompt_len + decode_steps bytes
scored per sequence, batch sequences from distinct places.
"""
from __future__ import annotations

import math
import sysconfig
from pathlib import Path
from typing import Any

import numpy as np
import torch


def held_out_bytes(after_mb: float, nbytes: int) -> bytes:
    """`nbytes` of the standard library's sources (sorted paths, as stdlib_corpus reads them) that
    come after the first `after_mb` megabytes: text a model trained on data=text never saw."""
    root = Path(sysconfig.get_paths()["stdlib"])
    skip, out, size = int(after_mb * 1e6), [], 0
    for path in sorted(root.glob("*.py")):
        data = path.read_bytes()
        if skip >= len(data):
            skip -= len(data)
            continue
        out.append(data[skip:])
        skip = 0
        size += len(out[-1])
        if size >= nbytes:
            break
    text = b"".join(out)[:nbytes]
    if len(text) < nbytes:
        raise ValueError(f"the standard library holds {len(text)} bytes after the first {after_mb} MB, and {nbytes} are needed")
    return text


def held_out_tokens(batch: int, length: int, after_mb: float) -> np.ndarray:
    """(batch, length) int32 byte ids: `batch` windows of held-out text, each from its own stretch."""
    text = np.frombuffer(held_out_bytes(after_mb, batch * length), dtype=np.uint8)
    return text.reshape(batch, length).astype(np.int32)


def _nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """-log p(target) per sequence from (B, V) logits, in float64."""
    z = logits.astype(np.float64)
    z = z - z.max(axis=-1, keepdims=True)
    log_z = np.log(np.exp(z).sum(axis=-1))
    return log_z - z[np.arange(len(targets)), targets]


def perplexity(runner: Any, tokens: np.ndarray, prompt_len: int) -> float:
    """exp(mean negative log-likelihood) of tokens[:, prompt_len:] given what comes before each,
    through `runner`'s prefill and teacher-forced decode calls (IreeRunner or TorchRunner)."""
    batch, length = tokens.shape
    nll = []
    _, logits = runner.prefill(tokens[:, :prompt_len])
    nll.append(_nll(runner.logits(logits), tokens[:, prompt_len]))
    for pos in range(prompt_len, length - 1):
        fed = tokens[:, pos].astype(np.int32)
        _, logits = runner.decode(runner.host_tokens(fed), pos)
        nll.append(_nll(runner.logits(logits), tokens[:, pos + 1]))
    return math.exp(float(np.mean(nll)))


@torch.no_grad()
def torch_perplexity(lm, tokens: np.ndarray, prompt_len: int) -> float:
    """The same through an EdgeLM in torch (fp32 on the CPU: the reference, or its quantized copy)."""
    lm.resize_cache(tokens.shape[0])
    dev = lm.k_cache.device
    nll = []
    _, logits = lm.prefill(torch.from_numpy(tokens[:, :prompt_len]).to(dev))
    nll.append(_nll(logits.float().cpu().numpy(), tokens[:, prompt_len]))
    for pos in range(prompt_len, tokens.shape[1] - 1):
        _, logits = lm.decode(torch.from_numpy(tokens[:, pos].astype(np.int32)).to(dev), torch.tensor([pos], dtype=torch.int32, device=dev))
        nll.append(_nll(logits.float().cpu().numpy(), tokens[:, pos + 1]))
    return math.exp(float(np.mean(nll)))


def quality(runner: Any, reference, quantized, batch: int, prompt: int, steps: int, vocab: int, after_mb: float) -> dict[str, Any]:
    """summary.json's quality figures for `batch` sequences of `prompt` + `steps` + 1 held-out bytes:
    perplexity through the module, through torch fp32 with the trained weights and (quantized) with
    the module's weights, and the module's rise over fp32."""
    if vocab < 256:
        return {"perplexity": None, "na_perplexity": "the model's vocabulary holds fewer than the 256 byte ids of the held-out text"}
    tokens = held_out_tokens(batch, prompt + steps + 1, after_mb)
    fp32 = torch_perplexity(reference, tokens, prompt)
    ppl = perplexity(runner, tokens, prompt)
    return {"perplexity": ppl, "perplexity_fp32": fp32, "perplexity_increase": ppl / fp32 - 1,
            "perplexity_quantized_torch": torch_perplexity(quantized, tokens, prompt) if quantized is not None else None,
            "perplexity_tokens": batch * (steps + 1), "uniform_perplexity": float(vocab)}
