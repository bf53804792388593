"""Bound verdicts per kernel from Speed-of-Light percentages (docs/SEED.md section 2).

docs/SEED.md's table gives typical readings: memory-bound kernels run SM < 25% with HBM > 75%,
compute-bound ones SM > 75% with HBM < 50%. Real kernels sit between: silu reads SM just under 75%
with HBM just over it (shared/fixtures/ncu), which the literal pair misses although HBM is the unit at its
limit and fusing the op away is exactly the remedy. So the verdict goes to the unit nearest its
peak once that unit is past its threshold; the seed's pairs mark a verdict as "textbook". A
kernel whose SM sits idle (< 25%) while HBM does most of the work (>= 50%) is memory-bound too:
AdamW's multi_tensor_apply reads SM 19% / HBM 70% on mini_llm, moving bytes and nothing else. A
kernel with neither unit past its threshold is limited by latency (or, when few warps are
resident, occupancy): fewer, larger launches help it, not fusion for bandwidth.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from src.config.tasks import Thresholds  # the schema of diagnose.classifier: its fields are settings

SEED_THRESHOLDS = Thresholds()

MEMORY_BOUND, COMPUTE_BOUND, NEITHER = "memory-bound", "compute-bound", "neither"

REMEDIES = {
    MEMORY_BOUND: "kernel fusion (Triton / torch.compile), quantization (FP8/INT4), or a larger batch",
    COMPUTE_BOUND: "lower precision (FP8/NVFP4), Tensor Core tile alignment (multiples of 64/128), or bigger GPUs",
    "latency": "fewer, larger launches: fuse with neighbouring ops, CUDA graphs, more work per launch",
    "occupancy": "raise occupancy: smaller blocks or fewer registers/shared memory per block, more blocks per launch",
}
# A GEMM below the compute roof is not helped by smaller blocks (cuBLAS picked its tiles); at
# mini_llm's sizes they read SM a little under the compute threshold: give each call more work, or cheaper work.
GEMM_REMEDY = "more work per GEMM (larger batch x seq, QKV / gate-up projections merged into one GEMM), FP8, shapes in multiples of 128"


@dataclass(frozen=True)
class Verdict:
    bound: str
    """memory-bound, compute-bound or neither"""
    limiter: str
    """hbm, sm, latency or occupancy"""
    textbook: bool
    """both of docs/SEED.md's readings hold, not just the dominant unit's"""
    remedy: str
    margin_pct: float = math.nan
    """percentage points to the nearest threshold (or SM/HBM crossover) that would change the verdict:
    under ~1 the verdict is a coin toss between two readings of the same kernel"""


def margin(sm_pct: float, hbm_pct: float, t: Thresholds) -> float:
    return min(abs(hbm_pct - t.hbm_bound_pct), abs(sm_pct - t.sm_bound_pct), abs(sm_pct - t.sm_idle_pct),
               abs(hbm_pct - t.hbm_low_pct), abs(hbm_pct - sm_pct))


def classify(sm_pct: float, hbm_pct: float, occupancy_pct: float | None = None, t: Thresholds = SEED_THRESHOLDS) -> Verdict:
    if math.isnan(sm_pct) or math.isnan(hbm_pct):
        return Verdict(NEITHER, "unknown", False, "profile with --section SpeedOfLight to get SM and DRAM throughput")
    v = _verdict(sm_pct, hbm_pct, occupancy_pct, t)
    return Verdict(v.bound, v.limiter, v.textbook, v.remedy, round(margin(sm_pct, hbm_pct, t), 2))


def _verdict(sm_pct: float, hbm_pct: float, occupancy_pct: float | None, t: Thresholds) -> Verdict:
    if hbm_pct >= t.hbm_bound_pct and hbm_pct >= sm_pct:
        return Verdict(MEMORY_BOUND, "hbm", sm_pct < t.sm_idle_pct, REMEDIES[MEMORY_BOUND])
    if sm_pct < t.sm_idle_pct and hbm_pct >= t.hbm_low_pct:  # idle SMs, busy HBM: bytes are the work
        return Verdict(MEMORY_BOUND, "hbm", False, REMEDIES[MEMORY_BOUND])
    if sm_pct >= t.sm_bound_pct and sm_pct > hbm_pct:
        return Verdict(COMPUTE_BOUND, "sm", hbm_pct < t.hbm_low_pct, REMEDIES[COMPUTE_BOUND])
    limiter = "occupancy" if occupancy_pct is not None and occupancy_pct < t.occupancy_low_pct else "latency"
    return Verdict(NEITHER, limiter, False, REMEDIES[limiter])
