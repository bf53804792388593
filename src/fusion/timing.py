"""Median kernel time and the device's copy ceiling, the same way on every backend.

On CUDA, triton.testing.do_bench: CUDA events around each call, the L2 flushed between calls
(a 256 MB write), gradients reset to None so backward never pays an accumulation. On a CPU
(Triton's interpreter included, where times say nothing about a GPU) wall-clock medians.

do_bench's flush is a write, so each timed call starts with L2 full of the flush's dirty lines and
pays for writing some of them back beside its own bytes, so a copy reads slower that way than
chained. `chain_ms` times the case a step has: the op called on distinct inputs back to back, each
call finding L2 as the previous call left it.
"""
from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import torch


def median_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100, grad_to_none: Sequence[torch.Tensor] = ()) -> float:
    if device.type == "cuda":
        from triton.testing import do_bench

        return float(do_bench(fn, warmup=warmup_ms, rep=rep_ms, grad_to_none=list(grad_to_none) or None, return_mode="median"))
    times: list[float] = []
    deadline = time.perf_counter() + (warmup_ms + rep_ms) / 1e3
    fn()  # warm-up: compilation, allocator
    while len(times) < 3 or time.perf_counter() < deadline:
        for t in grad_to_none:
            t.grad = None
        t0 = time.perf_counter()
        fn()
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def peak_mb(fn: Callable[[], object], device: torch.device) -> float | None:
    """MB the caching allocator's peak rose above what was allocated before one call of `fn` (None off CUDA)."""
    if device.type != "cuda":
        return None
    torch.cuda.synchronize(device)
    base = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    fn()
    torch.cuda.synchronize(device)
    return (torch.cuda.max_memory_allocated(device) - base) / 2**20


def copy_ceiling_tbs(device: torch.device, nbytes: int, warmup_ms: float = 25, rep_ms: float = 100) -> float:
    """Effective bandwidth of dst.copy_(src) over `nbytes` (read once, written once): the most a
    memory-bound kernel can hope for on this device, below the datasheet's peak."""
    src = torch.empty(nbytes // 4, dtype=torch.float32, device=device).uniform_()
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src), device, warmup_ms, rep_ms)
    return 2 * src.numel() * 4 / (ms * 1e-3) / 1e12


# A CUDA stream holds about 1000 launches pending; past that each launch blocks until a kernel
# ends. A timed batch must queue fewer or its host time waits on the GPU and its "host ahead" never
# is: a transformer block's forward + backward is hundreds of launches, and a few dozen blocks
# behind one spin read their GPU time as host time. No launch costs the host less than a few
# microseconds, so a batch of at most QUEUE_HOST_US of host stays well inside the queue. A call
# longer than that is queued alone (a block); the untimed call that leads each batch is issued
# before the spin, so its launches have drained by the time the timed ones queue.
QUEUE_HOST_US = 1000.0


def _batching(fn: Callable[[], object], device: torch.device, calls: int, batches: int) -> tuple[int, int]:
    """(calls a timed batch may queue, batches): `calls`, fewer where one call's host path is long
    enough that `calls` of them would fill the stream's launch queue (QUEUE_HOST_US), and then at
    least 9 batches so the median still has enough of them; never fewer than one call, so a single
    call must stay under the queue's ~1000 launches (a block's forward + backward is 100-250). One
    call's host time is the median of three, so one slow call (a collection, a late autotune) does
    not shrink every batch."""
    torch.cuda.synchronize(device)
    fn()  # the host's wake-up after the sync, before the spin: its launches drain while the spin queues
    torch.cuda._sleep(100_000_000)  # ~50 ms: the three calls queue behind it, never waiting on a kernel
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e6)
    torch.cuda.synchronize(device)
    fewer = max(1, min(calls, int(QUEUE_HOST_US // max(statistics.median(times), 1.0))))
    return fewer, batches if fewer == calls else max(batches, 9)


def host_us_per_call(fn: Callable[[], object], device: torch.device, calls: int = 30, batches: int = 5) -> float:
    """CPU microseconds to issue one call, with the GPU kept busy so the host never waits for it
    (torch.cuda._sleep queues a spin of ~50 ms ahead of each batch of calls): the median over
    `batches` batches, since one batch's mean varies widely between two readings of the same op. A
    call whose host path is long is issued fewer times a batch (at most QUEUE_HOST_US of host, so
    the stream's launch queue never fills), over more batches. Where this
    exceeds the call's GPU time, the op is host-bound: the GPU idles between its kernels unless a
    CUDA graph replays them."""
    fn()
    means = []
    if device.type != "cuda":
        # on a CPU the call is its own host time, kernels included: one short batch says it (30 calls
        # of a Triton kernel in the interpreter took most of a CPU kernel bench's time)
        batches, calls = 1, min(calls, 3)
    else:
        calls, batches = _batching(fn, device, calls, batches)
    for _ in range(batches):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            fn()  # untimed, ahead of the spin: the first call after a sync pays the host's wake-up, which a step's calls do not
            torch.cuda._sleep(100_000_000)  # ~50 ms at 2 GHz: longer than a batch's QUEUE_HOST_US of host
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        means.append((time.perf_counter() - t0) / calls * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return statistics.median(means)


def queued_ms(fn: Callable[[], object], device: torch.device, calls: int = 20, batches: int = 5) -> float:
    """Median GPU ms per call of `fn` called back to back with the host ahead of the device, as in
    a training step that never syncs: a ~50 ms spin (torch.cuda._sleep) is queued first, so all
    `calls` calls are queued before the device reaches them, and CUDA events after the spin and
    after the last call time the kernels with no host path between them. Unlike a CUDA graph it
    takes any op (eager RMSNorm's backward cannot be captured on torch 2.11); unlike do_bench it
    leaves L2 as the previous call left it, as consecutive layers do. A call with a long host path
    is queued fewer times a batch, so the stream's launch queue never fills (QUEUE_HOST_US). A batch
    whose queuing outlasted the spin (the device reached the first call before the host issued the
    last) is run again with a spin four times longer. Off CUDA: median_ms."""
    if device.type != "cuda":
        return median_ms(fn, device)
    for _ in range(3):  # compilation, autotuning, the allocator's first blocks
        fn()
    calls, batches = _batching(fn, device, calls, batches)
    per_call, spin = [], 100_000_000  # ~50 ms at 2 GHz: longer than a batch's QUEUE_HOST_US of host
    while len(per_call) < batches:
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        fn()  # untimed, ahead of the spin, as in host_us_per_call: the host's wake-up after the sync is not the call's
        torch.cuda._sleep(spin)
        start.record()
        for _ in range(calls):
            fn()
        ahead = not start.query()  # the spin outlasted the queuing: the device never waited for the host
        end.record()
        end.synchronize()
        if ahead or spin >= 1_600_000_000:  # ~0.8 s of spin and still behind: the host is the limit, and the time says so
            per_call.append(start.elapsed_time(end) / calls)
        else:
            spin *= 4
    return statistics.median(per_call)


def graph_ms(fn: Callable[[], object], device: torch.device, warmup_ms: float = 25, rep_ms: float = 100, grad_to_none: Sequence[torch.Tensor] = ()) -> float | None:
    """Median GPU time of `fn` captured once into a CUDA graph and replayed: the kernels alone, with
    no host path between them. None off CUDA; raises where `fn` cannot be captured (a host sync)."""
    if device.type != "cuda":
        return None
    return median_ms(_captured(fn, device, 3, grad_to_none).replay, device, warmup_ms, rep_ms)


def _captured(fn: Callable[[], object], device: torch.device, warmups: int, grad_to_none: Sequence[torch.Tensor] = ()) -> torch.cuda.CUDAGraph:
    """`fn` captured once into a CUDA graph, after `warmups` calls on a side stream off the capture
    (compilation, allocator, autotuning), each with `grad_to_none`'s gradients reset."""
    side = torch.cuda.Stream(device)
    side.wait_stream(torch.cuda.current_stream(device))
    with torch.cuda.stream(side):
        for _ in range(warmups):
            for t in grad_to_none:
                t.grad = None
            fn()
    torch.cuda.current_stream(device).wait_stream(side)
    for t in grad_to_none:
        t.grad = None
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


# chain_ms: the ring of input sets moves at least CHAIN_L2_MULTIPLE times the L2's bytes per pass, so
# a call's inputs were evicted by the calls between two of its replays (4x: LRU-like replacement
# keeps nothing of a set three L2-fulls back), in CHAIN_MIN_CALLS to CHAIN_MAX_CALLS calls.
CHAIN_L2_MULTIPLE = 4
CHAIN_MIN_CALLS, CHAIN_MAX_CALLS = 4, 32


def chain_calls(l2_bytes: int, nbytes_per_call: int) -> int:
    """How many distinct input sets chain_ms cycles through for a call that moves `nbytes_per_call`
    on a device with `l2_bytes` of L2."""
    return max(CHAIN_MIN_CALLS, min(CHAIN_MAX_CALLS, math.ceil(CHAIN_L2_MULTIPLE * l2_bytes / max(1, nbytes_per_call))))


def chain_ms(make_run: Callable[[], Callable[[], object]], device: torch.device, nbytes_per_call: int, rep_ms: float = 100, batches: int = 5) -> float | None:
    """Median GPU ms per call of an op in a chain: `make_run()` builds one call on its own inputs
    (chain_calls of them, so the ring outgrows L2), all captured back to back into one CUDA graph,
    replayed with nothing between replays. Each call starts with L2 holding (and dirty with) the
    previous call's bytes, not its own, as a layer of a step does; no flush is charged to it, as
    do_bench charges one (module docstring). None off CUDA; raises where a call cannot be captured."""
    if device.type != "cuda":
        return None
    runs = [make_run() for _ in range(chain_calls(torch.cuda.get_device_properties(device).L2_cache_size, nbytes_per_call))]

    def chain() -> None:
        for run in runs:
            run()

    graph = _captured(chain, device, 1)
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    graph.replay()
    end.record()
    end.synchronize()
    replays = max(1, round(rep_ms / max(start.elapsed_time(end), 1e-3) / batches))
    per_call = []
    for _ in range(batches):
        start.record()
        for _ in range(replays):
            graph.replay()
        end.record()
        end.synchronize()
        per_call.append(start.elapsed_time(end) / (replays * len(runs)))
    return statistics.median(per_call)
