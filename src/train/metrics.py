"""Throughput, MFU and memory figures for a training step.

MFU follows torchtitan: 100 * flops_per_token * tokens_per_s_per_device / peak_flops, where each
model counts its own flops_per_token (src/models/protocol.py: 6 x the parameters a token multiplies,
plus 12 x layers x heads x head_dim x seq_len for attention), and peak is the datasheet's dense rate
for the device and compute dtype. Where no peak is known (a CPU, an
unlisted GPU) MFU is None and shows as "n/a": a made-up denominator would make it meaningless.
"""
from __future__ import annotations

import os
import resource
import sys

import torch

# Dense (no 2:4 sparsity) datasheet peaks in FLOP/s, by a substring of the device name.
# bf16 is the MFU denominator torchtitan uses; tf32 is what an fp32 matmul runs at when allowed.
PEAK_FLOPS = {
    "H200": {"bfloat16": 989e12, "float16": 989e12, "tf32": 494.5e12, "float32": 67e12},
    "H100": {"bfloat16": 989e12, "float16": 989e12, "tf32": 494.5e12, "float32": 67e12},
    "B200": {"bfloat16": 2250e12, "float16": 2250e12, "tf32": 1100e12, "float32": 80e12},
    "A100": {"bfloat16": 312e12, "float16": 312e12, "tf32": 156e12, "float32": 19.5e12},
    "L40S": {"bfloat16": 362e12, "float16": 362e12, "tf32": 183e12, "float32": 91.6e12},
    "A10G": {"bfloat16": 70e12, "float16": 70e12, "tf32": 35e12, "float32": 31.2e12},
}


def peak_flops(device: torch.device, compute_dtype: str) -> float | None:
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    dtype = compute_dtype
    if dtype == "float32" and torch.backends.cuda.matmul.allow_tf32:
        dtype = "tf32"
    for key, table in PEAK_FLOPS.items():
        if key in name:
            return table.get(dtype)
    return None


def mfu_percent(fpt: float, tokens_per_s_per_device: float, peak: float | None) -> float | None:
    return None if not peak else 100.0 * fpt * tokens_per_s_per_device / peak


def causal_flops_per_token(fpt: float, attention: float, causal: bool) -> float:
    """flops_per_token with a causal mask's attention halved (Megatron-Bridge's count): the same step
    reads about 5% lower MFU at LLaMA 3.2 1B and seq 2048. Without the mask the two counts agree."""
    return fpt - attention / 2 if causal else fpt


def energy_and_cost(summary: dict, gpu_hour_price: float) -> dict:
    """joules_per_token (rank 0's median GPU power over its tokens/s) and cost_per_mtok (the price of
    a GPU-hour per million tokens), with `na`: why a figure is missing, by name."""
    tps, power = summary.get("tokens_per_s_per_device"), summary.get("gpu_power_w")
    out: dict = {"joules_per_token": None, "cost_per_mtok": None, "na": {}}
    if not tps:
        out["na"].update(joules_per_token="no timed step", cost_per_mtok="no timed step")
        return out
    if power:
        out["joules_per_token"] = power / tps
    else:
        out["na"]["joules_per_token"] = "no GPU power reading (a CPU run, no NVML, or train.gpu_clock_interval_s=0)"
    if gpu_hour_price > 0:
        out["cost_per_mtok"] = gpu_hour_price / 3600 / tps * 1e6
    else:
        out["na"]["cost_per_mtok"] = "no price: set train.gpu_hour_price to one GPU-hour's price"
    return out


def reset_peak_memory(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def peak_memory_gb(device: torch.device) -> tuple[float, float]:
    """(allocated, reserved) peak in GB (1e9 bytes, as the seed prints). On a CPU there is no caching
    allocator: both are the process's peak resident set size."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, torch.cuda.max_memory_reserved(device) / 1e9
    if device.type == "mps":
        return torch.mps.driver_allocated_memory() / 1e9, torch.mps.driver_allocated_memory() / 1e9
    rss_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    rss = rss_kb if sys.platform == "darwin" else rss_kb * 1024
    return rss / 1e9, rss / 1e9


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def host_rss_mb() -> float | None:
    """This process's resident set size now, in MB (1e6 bytes). /proc/self/statm is one read of
    a few dozen bytes, cheap enough for every logged step; elsewhere (macOS) psutil, where installed."""
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE / 1e6
    except OSError:
        try:
            import psutil

            return psutil.Process().memory_info().rss / 1e6
        except ImportError:
            return None


def format_metric(value: float | None, fmt: str = "{:.1f}") -> str:
    return "n/a" if value is None else fmt.format(value)
