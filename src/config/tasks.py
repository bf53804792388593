"""Schemas of the per-task sections of the run config: profile, diagnose, kernel_bench, edge.

Apart from src/config/schema.py so each file stays one screenful of schemas; schema.py imports them
into RunConfig, and `--help` reads the field docstrings of both files (src/config/help.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

from src.dtypes import Dtype, ShortDtype
from src.fusion.ops import BENCHES


class BenchMode(StrEnum):
    fwd = "fwd"
    fwd_bwd = "fwd_bwd"
    bwd = "bwd"  # the backward alone, its forward run once outside the timing: what a training step's backward pass times


class HostWait(StrEnum):
    auto = "auto"
    poll = "poll"
    block = "block"


class TokenOut(StrEnum):
    caller = "caller"
    result = "result"


class EdgeAction(StrEnum):
    bench = "bench"
    compile = "compile"
    run = "run"


class EdgeQuant(StrEnum):
    none = "none"
    int8 = "int8"
    int4 = "int4"


@dataclass
class ProfileConfig:
    """task=profile: torch.profiler over the training loop; and NVTX annotation for ncu / nsys."""

    wait: int = 1
    """steps skipped before the profiler starts"""
    warmup: int = 1
    """steps traced but discarded (profiler warm-up)"""
    active: int = 3
    """steps recorded"""
    record_shapes: bool = True
    profile_memory: bool = True
    with_stack: bool = False
    """Python stacks in the trace: much larger traces"""
    row_limit: int = 25
    """rows of the key_averages table"""
    nvtx: bool = False
    """push an NVTX range per module (fwd/layers.3.ffn) and around loss, backward, optimizer"""
    nvtx_step: int = -1
    """the step wrapped in the NVTX range 'profiled_step' (what task=diagnose gives ncu); -1: none"""
    gemm_peak_tflops: float = 790.0
    """the GEMM floor's rate in anatomy.json: model FLOPs per step / this (790: bf16 dense GEMM measured on H200)"""


@dataclass
class Thresholds:
    """diagnose.classifier: docs/SEED.md's readings for the bound verdict (src/profiling/classify.py applies them)."""

    hbm_bound_pct: float = 75.0
    """HBM throughput at or above this, with HBM the busiest unit: memory-bound"""
    sm_bound_pct: float = 75.0
    """SM throughput at or above this, with SM the busiest unit: compute-bound"""
    sm_idle_pct: float = 25.0
    """docs/SEED.md's 'Tensor Cores sit idle' mark: a memory-bound kernel below it is textbook, and
    below it any kernel with HBM >= hbm_low_pct is memory-bound"""
    hbm_low_pct: float = 50.0
    """docs/SEED.md's 'low to moderate HBM' mark: a compute-bound kernel below it is textbook"""
    occupancy_low_pct: float = 40.0
    """achieved occupancy below this names occupancy, not latency, as the limiter"""


@dataclass
class DiagnoseConfig:
    """task=diagnose: one training step under Nsight Compute, then the bound verdict per op."""

    step: int = 2
    """the step that ncu profiles; earlier ones warm up allocator and autotuning"""
    sections: list[str] = field(default_factory=lambda: ["SpeedOfLight", "SpeedOfLight_RooflineChart", "Occupancy", "LaunchStats"])
    ncu: str = ""
    """path to ncu; empty finds it on PATH or under /opt/nvidia/nsight-compute"""
    timeout_s: int = 3600
    launch_count: int = 0
    """profile at most this many kernels of the step (0: all)"""
    report: str = ""
    """diagnose this existing report instead of running ncu"""
    classifier: Thresholds = field(default_factory=Thresholds)
    """docs/SEED.md's readings for the bound verdict (src/profiling/classify.py explains the rule)"""


def _bench_shapes() -> dict[str, list[list[int]]]:
    return {b.name: [list(shape) for shape in b.shapes] for b in BENCHES}


@dataclass
class KernelBenchConfig:
    """task=kernel_bench (+exp=kernels): the fused kernels against eager, torch.compile and Liger."""

    ops: list[str] = field(default_factory=lambda: [b.name for b in BENCHES])
    """the op table's benches (src/fusion/ops.py)"""
    shapes: dict[str, list[list[int]]] = field(default_factory=_bench_shapes)
    """op -> shapes: [rows, width], or [tokens, dim, vocab] for linear_cross_entropy"""
    providers: list[str] = field(default_factory=lambda: ["eager", "compile", "triton", "liger"])
    """eager, compile, triton, liger (only where Liger-Kernel is installed); a str list, as ops:
    src/kernel_bench/checks.py names each unknown one, where an enum list names only the first"""
    modes: list[BenchMode] = field(default_factory=lambda: [BenchMode.fwd, BenchMode.fwd_bwd])
    """fwd, fwd_bwd (a forward and its backward, back to back), bwd (the backward alone: in a step a layer's
    backward runs long after its forward, so its chain figure reads none of what the forward left in L2;
    no rows for cross_entropy and linear_cross_entropy, whose fused variants compute the gradient in the forward)"""
    dtype: Dtype = Dtype.bfloat16
    warmup_ms: int = 25
    rep_ms: int = 100
    """do_bench's budget per measurement (its defaults)"""
    copy_mb: int = 1024
    """buffer copied to measure the device's copy ceiling"""
    chain: bool = True
    """also time each capturable variant as a chain over distinct inputs (src/fusion/timing.py chain_ms): L2 as
    a step leaves it, without do_bench's flush; costs one graph of 4-32 calls' inputs per row"""


@dataclass
class EdgeConfig:
    """task=infer (+exp=edge): prefill + decode on an edge backend against torch on the CPU."""

    action: EdgeAction = EdgeAction.bench
    """bench: compile (cached) and time here; compile: write artifacts for another device; run: time compiled artifacts"""
    target: str = ""
    """backend=vulkan: --iree-vulkan-target (llvmpipe, ampere, rdna3, valhall, adreno, sm_XX, gfxNNNN; empty: llvmpipe);
    backend=mps with action=compile: the Metal platform (macos, ios; empty: macos)"""
    target_features: str = ""
    """backend=vulkan: --iree-vulkan-target-features, replacing the target's defaults (e.g. to drop cooperative matrices)"""
    artifacts: str = ""
    """action=run: a directory that action=compile wrote; action=compile: where to write (default: the run directory)"""
    cache_dir: str = "~/.cache/perflab/edge"
    """compiled modules, keyed by model config, shapes, dtype, target and flags"""
    batch: int = 1
    prompt_len: int = 32
    """tokens in the prompt (the prefill)"""
    decode_steps: int = 16
    """tokens generated after the prompt, one decode call each"""
    max_seq: int = 0
    """KV-cache positions; 0: prompt_len + decode_steps"""
    dtype: ShortDtype = ShortDtype.fp32
    """fp32, fp16, or bf16 (where the device computes in it)"""
    weights: str = ""
    """a safetensors export of a trained model (python -m src.export); empty: the seeded initialisation"""
    warmup: int = 2
    repeats: int = 10
    """timed generations (prefill + decode_steps) after the first"""
    seed: int = 0
    runtime_flags: list[str] = field(default_factory=list)
    """backend=vulkan: IREE runtime flags, e.g. edge.runtime_flags='["--vulkan_tracing=false"]'"""
    host_wait: HostWait = HostWait.auto
    """backend=vulkan: how the host waits for a decode call and a token read: poll the semaphore
    (as CUDA's default sync spins), or block in the driver; auto polls on a GPU and blocks on
    lavapipe, whose CPU threads the poll would take"""
    token_out: TokenOut = TokenOut.caller
    """backend=vulkan: where a decode step's token goes: caller (decode_token_into, the runner's own
    mapped host-visible buffers: no result allocation, no copy to read it) or result (decode_token's
    result buffer, read through a copy); modules without decode_token_into take result"""
    quant: EdgeQuant = EdgeQuant.none
    """weight-only quantization of the blocks' Linear weights (src/edge/quant.py): none, int8 (per
    output channel) or int4 (groups of quant_group along the input, two a byte); stored so in the
    parameter archive and dequantized in the module before each matmul; embedding and head stay in dtype"""
    quant_group: int = 32
    """int4: weights sharing a scale (32 divides every width of tiny and small; 128 does not divide tiny's 64)"""
    quality_tolerance: float = 0.05
    """the largest rise of perplexity on held-out text over torch fp32's (0.05: 5%) a run may have and still be
    a sweep's best; a run past it is left out of the ranking, saying so"""
    matvec_rows: int = 8
    """IREE modules at batch 2 or more: Linear products of 2 to this many rows (decode at batch <= it)
    exported weights first, (W @ x^T)^T, which IREE compiles as matrix-vector kernels rather than a
    general matmul on a few workgroups (src/edge/matvec.py); 0: off; at most 8. Torch backends
    ignore it"""
