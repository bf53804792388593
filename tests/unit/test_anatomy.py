"""Step anatomy (src/profiling/anatomy.py): interval arithmetic on hand-built kernel timelines, and a
hand-built GPU trace read the way torch.profiler writes one (kernels tied to their launches)."""
from __future__ import annotations

import pytest

from src.profiling.anatomy import (
    NO_OP,
    HostThread,
    Kernel,
    anatomy_from_trace,
    category,
    device_anatomy,
    format_table,
    kernel_family,
    merge,
    metrics,
    overlap,
    short_kernel_name,
)


def test_merge_and_overlap_of_intervals():
    assert merge([(5, 9), (0, 2), (1, 3), (9, 10), (4, 4)]) == [(0, 3), (5, 10)]  # touching joins; empty dropped
    assert overlap(merge([(0, 10), (20, 30)]), merge([(5, 25)])) == 10
    assert overlap([(0, 1)], [(2, 3)]) == 0


def test_exposed_communication_and_idle_on_a_hand_built_timeline():
    """Two steps. Compute on stream 7: [0, 10) GEMM, [12, 20) elementwise, [22, 25) GEMM; on stream 8 an
    optimizer kernel [18, 21) beside them; NCCL on stream 20: [5, 15) and [30, 34).
    Exposed NCCL: [10, 12) (2 us) and [30, 34) (4 us, nothing else runs) = 6 us.
    Busy: [0, 21) + [22, 25) + [30, 34) = 28 us of the window [0, 34): idle 6 us."""
    ks = [
        Kernel("nvjet_tst_gemm", 0, 10, 7, "gemm"), Kernel("vectorized_elementwise", 12, 8, 7, "norm_elementwise_cast"),
        Kernel("nvjet_tst_gemm", 22, 3, 7, "gemm"), Kernel("multi_tensor_apply_kernel", 18, 3, 8, "optimizer"),
        Kernel("ncclDevKernel_AllGather_RING_LL", 5, 10, 20, "communication"),
        Kernel("ncclDevKernel_ReduceScatter_RING_LL", 30, 4, 20, "communication"),
    ]
    a = device_anatomy(ks, steps=2)
    ms = 1e-3 / 2  # microseconds over two steps, in ms per step
    assert a["communication_exposed_ms"] == pytest.approx(6 * ms)
    assert a["idle_ms"] == pytest.approx(6 * ms) and a["busy_ms"] == pytest.approx(28 * ms)
    assert a["step_ms"] == pytest.approx(34 * ms)
    assert a["categories_ms"]["gemm"] == pytest.approx(13 * ms) and a["categories_ms"]["communication"] == pytest.approx(14 * ms)
    assert a["categories_ms"]["attention"] == 0 and set(a["categories_ms"]) >= {"fsdp_copy", "other"}


def test_nccl_fully_hidden_under_compute_is_not_exposed():
    ks = [Kernel("gemm", 0, 100, 7, "gemm"), Kernel("nccl", 10, 50, 20, "communication"), Kernel("nccl", 60, 40, 21, "communication")]
    a = device_anatomy(ks, steps=1)
    assert a["communication_exposed_ms"] == 0 and a["idle_ms"] == 0 and a["step_ms"] == pytest.approx(0.1)


def test_categories_by_name_and_by_the_range_a_kernel_was_launched_in():
    cat = "void at::native::(anonymous namespace)::CatArrayBatchedCopy<float>"
    assert category(cat, in_fsdp=True) == "fsdp_copy" and category(cat) == "norm_elementwise_cast"  # FSDP2's, or the model's
    assert category("void at::native::detail::chunk_cat_cuda_kernel<char, char>") == "fsdp_copy"
    assert category("void at::native::split_with_sizes_copy_out_contiguous_no_cast_kernel") == "fsdp_copy"
    assert category("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)", in_fsdp=True) == "communication"
    assert category("void at::native::vectorized_elementwise_kernel<4, CopyFunctor>", in_fsdp=True) == "fsdp_copy"
    assert category("void at::native::vectorized_elementwise_kernel<4, AUnaryFunctor>", in_optimizer=True) == "optimizer"
    assert category("triton_poi_fused__to_copy_mul_silu_0") == "norm_elementwise_cast"
    assert category("nvjet_tst_192x192_64x4_1x2_h_bz_coopA_TNT") == "gemm"
    # the float8 casts are casts (the float8 step's 7.5 ms of them once read as "other"); float8 GEMMs stay GEMMs
    assert category("_rowwise_e4m3") == category("_transposed_e4m3_1") == category("_transposed_e4m3_from_rowwise_4") == "norm_elementwise_cast"
    assert category("_rowwise_e4m3_pieces") == "norm_elementwise_cast"
    assert category("void cutlass::device_kernel<cutlass::gemm::kernel::GemmUniversal<cutlass::float_e4m3_t>>") == "gemm"
    assert category("void pytorch_flash::flash_fwd_kernel<Flash_fwd_kernel_traits>") == "attention"


def _x(name, cat, ts, dur, tid=1, pid=1, **args):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur, "pid": pid, "tid": tid, "args": args}


def test_a_gpu_trace_ties_kernels_to_the_fsdp_and_optimizer_ranges_they_were_launched_in():
    """One step: FSDP's all-gather range launches its copy-in and NCCL; the forward a GEMM; the
    optimizer step a kernel. Device 0's kernels on streams 7 and 20, a stray one on device 1."""
    events = [
        _x("ProfilerStep#3", "user_annotation", 0, 500),
        _x("FSDP::all_gather (layers.0)", "user_annotation", 10, 30),
        _x("cudaLaunchKernel", "cuda_runtime", 12, 2, correlation=1),
        _x("cuLaunchKernelEx", "cuda_driver", 20, 2, correlation=2),
        _x("cudaLaunchKernel", "cuda_runtime", 50, 2, correlation=3),
        _x("Optimizer.step#AdamW.step", "user_annotation", 300, 100),
        _x("cudaLaunchKernel", "cuda_runtime", 310, 2, correlation=4),
        _x("vectorized_elementwise_kernel<CopyFunctor>", "kernel", 100, 20, pid=0, tid=7, device=0, stream=7, correlation=1),
        _x("ncclDevKernel_AllGather_RING_LL", "kernel", 120, 60, pid=0, tid=20, device=0, stream=20, correlation=2),
        _x("nvjet_tst_gemm", "kernel", 120, 220, pid=0, tid=7, device=0, stream=7, correlation=3),
        _x("vectorized_elementwise_kernel<CopyFunctor>", "kernel", 360, 40, pid=0, tid=7, device=0, stream=7, correlation=4),
        _x("nvjet_tst_gemm", "kernel", 0, 999, pid=1, tid=7, device=1, stream=7, correlation=9),
    ]
    a = anatomy_from_trace({"traceEvents": events}, flops_per_step=790e12 * 0.2e-3, gemm_peak_tflops=790)
    cats = a["categories_ms"]
    assert a["source"] == "device kernels" and a["profiled_steps"] == 1
    assert cats["fsdp_copy"] == pytest.approx(0.020) and cats["optimizer"] == pytest.approx(0.040)
    assert cats["gemm"] == pytest.approx(0.220) and cats["communication"] == pytest.approx(0.060)
    assert a["communication_exposed_ms"] == pytest.approx(0.0)  # [120, 180) lies under the GEMM and the copy
    assert a["step_ms"] == pytest.approx(0.300) and a["idle_ms"] == pytest.approx(0.020)  # [340, 360)
    # the kernel after the gap was launched at 310-312, before the device went idle at 340: queued
    assert (a["idle"]["queued_ms"], a["idle"]["host_ms"]) == (pytest.approx(0.020), 0.0)
    assert a["gemm_floor_ms"] == pytest.approx(0.200) and a["step_over_floor"] == pytest.approx(1.5)
    table = format_table(a)
    assert "FSDP2 copy-in/out" in table and "communication exposed" in table and "GEMM floor @790 TFLOP/s" in table
    assert metrics(a)["anatomy.step_over_floor"] == pytest.approx(1.5)


def test_a_device_behind_its_host_counts_only_the_profiled_steps_work():
    """Graph replays queue a step ahead: the window opens with the step before it still running on the
    device (its GEMM tail, launched before the window, and its optimizer kernel, whose launch the trace
    lacks) and closes with the last step's work still queued (a graph launched at 480 runs 560-760).
    Only what the window's step launched counts, and its device time is its own kernels' span."""
    events = [
        _x("ProfilerStep#5", "user_annotation", 0, 500),
        _x("cudaLaunchKernel", "cuda_runtime", -400, 2, correlation=1),  # the step before's GEMM
        _x("cudaGraphLaunch", "cuda_runtime", 20, 5, correlation=2),
        _x("Optimizer.step#TritonAdamW.step", "user_annotation", 470, 20),
        _x("cudaLaunchKernel", "cuda_runtime", 480, 2, correlation=3),
        _x("nvjet_sm90_qqtst_gemm", "kernel", 0, 100, pid=0, tid=7, device=0, stream=7, correlation=1),
        _x("_adamw_tiles", "kernel", 100, 50, pid=0, tid=7, device=0, stream=7, correlation=99),  # launch not in the trace
        _x("nvjet_sm90_qqtst_gemm", "kernel", 150, 300, pid=0, tid=7, device=0, stream=7, correlation=2),
        _x("_rowwise_e4m3", "kernel", 450, 100, pid=0, tid=7, device=0, stream=7, correlation=2),
        _x("_adamw_tiles", "kernel", 560, 200, pid=0, tid=7, device=0, stream=7, correlation=3),
    ]
    a = anatomy_from_trace({"traceEvents": events})
    cats = a["categories_ms"]
    assert cats["gemm"] == pytest.approx(0.300)  # the step before's 100 us GEMM left out
    assert cats["optimizer"] == pytest.approx(0.200)  # its own update, run after the window; not the one before
    assert cats["norm_elementwise_cast"] == pytest.approx(0.100)
    assert a["step_ms"] == pytest.approx(0.610) and a["idle_ms"] == pytest.approx(0.010)  # 150-760, idle [550, 560)


def test_a_kernel_whose_launch_is_not_traced_counts_inside_the_steps_span():
    """A kernel with no launch in the trace (a driver-side copy) that runs among the step's kernels is the
    step's; a trace without step ranges keeps every kernel."""
    events = [
        _x("ProfilerStep#1", "user_annotation", 0, 300),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 2, correlation=1),
        _x("cudaLaunchKernel", "cuda_runtime", 20, 2, correlation=2),
        _x("nvjet_tst_gemm", "kernel", 30, 100, pid=0, tid=7, device=0, stream=7, correlation=1),
        _x("Memset (Device)", "gpu_memset", 140, 10, pid=0, tid=7, device=0, stream=7, correlation=50),
        _x("nvjet_tst_gemm", "kernel", 160, 100, pid=0, tid=7, device=0, stream=7, correlation=2),
    ]
    a = anatomy_from_trace({"traceEvents": events})
    assert a["categories_ms"]["other"] == pytest.approx(0.010) and a["step_ms"] == pytest.approx(0.230)
    bare = anatomy_from_trace({"traceEvents": [e for e in events if e["name"] != "ProfilerStep#1"]})
    assert bare["step_ms"] == pytest.approx(0.230) and bare["categories_ms"]["gemm"] == pytest.approx(0.200)


def test_top_kernels_name_what_each_category_is_made_of():
    """Launches of one kernel group by name less the call's arguments, so a cast and an add (two
    instantiations of one elementwise kernel) stay apart; longest first, per step. The table shows
    templates one level deep, the functor kept."""
    cast = "void at::native::vectorized_elementwise_kernel<4, at::native::CopyFunctor<float>, std::array<char*, 2ul> >(int, ...)"
    add = "void at::native::vectorized_elementwise_kernel<4, at::native::CUDAFunctor_add<float>, std::array<char*, 3ul> >(int, ...)"
    assert kernel_family(cast) == cast.removesuffix("(int, ...)")
    assert short_kernel_name(kernel_family(cast)) == "void at::native::vectorized_elementwise_kernel<4, at::native::CopyFunctor<>, std::array<> >"
    assert kernel_family("ncclDevKernel_AllGather_RING_LL(ncclDevKernelArgsStorage<4096ul>)") == "ncclDevKernel_AllGather_RING_LL"
    adam = "void at::native::(anonymous namespace)::multi_tensor_apply_kernel<at::native::(anonymous namespace)::TensorListMetadata<4>, X>(Y)"
    assert kernel_family(adam) == "void at::native::multi_tensor_apply_kernel<at::native::TensorListMetadata<4>, X>"
    assert short_kernel_name("k" * 200, width=20) == "k" * 17 + "..."
    ks = [Kernel(cast, 0, 4, 7, "norm_elementwise_cast"), Kernel(cast, 10, 4, 7, "norm_elementwise_cast"),
          Kernel(add, 20, 6, 7, "norm_elementwise_cast"), Kernel("nvjet_tst_gemm", 30, 50, 7, "gemm")]
    a = device_anatomy(ks, steps=2)
    elementwise = a["top_kernels"]["norm_elementwise_cast"]
    assert [k["kernel"] for k in elementwise] == [kernel_family(cast), kernel_family(add)]
    assert elementwise[0]["ms"] == pytest.approx(8e-3 / 2) and elementwise[0]["calls"] == 1.0
    assert a["top_kernels"]["gemm"] == [{"kernel": "nvjet_tst_gemm", "ms": pytest.approx(25e-3), "calls": 0.5}]
    table = format_table({**a, "profiled_steps": 2, "source": "device kernels", "gemm_floor_ms": None})
    assert "longest kernels per category" in table and "CopyFunctor<>" in table and "    0.5x  nvjet_tst_gemm" in table


def test_idle_gaps_split_by_whether_the_host_had_launched_the_next_kernel():
    """Two steps of: GEMM [0, 10), then a gap the host causes (the norm's launch returns at 14,
    after the device idled at 10) to [15, 20), then a gap with the next kernel queued since 5 (it
    waits on another stream's event) to [23, 30); the second step the same, 100 us later, and one
    kernel whose launch the trace lacks."""
    ks = []
    for base in (0, 100):
        ks += [Kernel("gemm_a", base, 10, 7, "gemm", launched=base - 70.0),
               Kernel("rms_norm", base + 15, 5, 7, "norm_elementwise_cast", launched=base + 14.0),
               Kernel("adamw", base + 23, 7, 8, "optimizer", launched=base + 5.0)]
    ks.append(Kernel("copy", 40, 2, 7, "other"))  # [30, 40) before it, its launch unknown
    a = device_anatomy(ks, steps=2)
    idle = a["idle"]
    # [42, 100): the next step's GEMM was launched at 30, before the device idled at 42: queued
    assert idle["host_ms"] == pytest.approx(2 * 5e-3 / 2) and idle["queued_ms"] == pytest.approx((2 * 3 + 58) * 1e-3 / 2)
    assert idle["unknown_ms"] == pytest.approx(10e-3 / 2)
    assert a["idle_ms"] == pytest.approx((5 + 3 + 10 + 58 + 5 + 3) * 1e-3 / 2)
    longest = idle["longest"]
    assert longest[0] == {"cause": "queued", "before": "copy", "after": "gemm_a", "ms": pytest.approx(58e-3 / 2), "count": 0.5, "max_ms": pytest.approx(58e-3)}
    host = [g for g in longest if g["cause"] == "host"]
    assert host == [{"cause": "host", "before": "gemm_a", "after": "rms_norm", "ms": pytest.approx(5e-3), "count": 1.0, "max_ms": pytest.approx(5e-3)}]
    table = format_table({**a, "profiled_steps": 2, "source": "device kernels", "gemm_floor_ms": None})
    assert "  host late" in table and "  queued (not on a kernel)" in table and "  launch not traced" in table
    assert "longest idle gaps" in table and "max     0.01  host    gemm_a -> rms_norm" in table
    assert metrics(a)["anatomy.idle_host_late_ms"] == pytest.approx(5e-3)


def test_a_host_late_gap_names_what_the_launching_thread_did_in_it():
    """The GEMM ends at 120; the host reads a scalar (its sync returns at 121), then spends 510 us in
    the optimizer's range before launching its kernel at 650: the gap [120, 660) is host late, and the
    table names the optimizer's range as where the host was, with the step range and the read after it."""
    events = [
        _x("ProfilerStep#2", "user_annotation", 0, 1000),
        _x("cudaLaunchKernel", "cuda_runtime", 10, 2, correlation=1),
        _x("aten::item", "cpu_op", 100, 30),
        _x("cudaStreamSynchronize", "cuda_runtime", 102, 19),
        _x("Optimizer.step#TritonAdamW.step", "user_annotation", 140, 560),
        _x("cudaLaunchKernel", "cuda_runtime", 650, 2, correlation=2),
        _x("nvjet_tst_gemm", "kernel", 20, 100, pid=0, tid=7, device=0, stream=7, correlation=1),
        _x("_adamw_tiles", "kernel", 660, 40, pid=0, tid=7, device=0, stream=7, correlation=2),
    ]
    a = anatomy_from_trace({"traceEvents": events})
    (gap,) = a["idle"]["longest"]
    assert gap["cause"] == "host" and gap["max_ms"] == pytest.approx(0.540)
    # the window runs from the device idling (120) to the launch's return (652)
    assert gap["host_in_longest"] == [
        {"op": "Optimizer.step#TritonAdamW.step", "ms": pytest.approx(0.510)},  # 512 us less its launch call's 2
        {"op": "ProfilerStep#2", "ms": pytest.approx(0.010)},  # [130, 140): under the step range, no op
        {"op": "aten::item", "ms": pytest.approx(0.009)},  # [121, 130), its sync's last 1 us its own
    ]
    assert "host in the longest (ms): Optimizer.step#TritonAdamW.step 0.51, ProfilerStep#2 0.01, aten::item 0.01" in format_table(a)


def test_host_activity_counts_self_time_inside_the_window_and_time_under_no_op():
    thread = HostThread([{"name": "aten::copy_", "ts": 10, "dur": 10}, {"name": "cudaMemcpyAsync", "ts": 12, "dur": 2},
                         {"name": "aten::mul", "ts": 40, "dur": 5}])
    assert thread.activity(0, 30) == [{"op": NO_OP, "ms": pytest.approx(0.020)}, {"op": "aten::copy_", "ms": pytest.approx(0.008)},
                                      {"op": "cudaMemcpyAsync", "ms": pytest.approx(0.002)}]
    # an op that began before the window counts only its part inside it
    assert thread.activity(15, 20) == [{"op": "aten::copy_", "ms": pytest.approx(0.005)}]
    assert thread.activity(50, 60) == [{"op": NO_OP, "ms": pytest.approx(0.010)}]
