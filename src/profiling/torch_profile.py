"""task=profile: torch.profiler over the real training loop (docs/SEED.md section 2, step A).

A wait / warmup / active schedule skips the first steps (allocator warm-up, compilation), records
`active` steps once, and then writes, per rank: a Chrome/Perfetto trace (ui.perfetto.dev) and,
on rank 0, the key_averages table sorted by device time (CPU time on a CPU run), a memory
timeline, and the step's anatomy read back from the trace (src/profiling/anatomy.py: the step's
time by category, exposed communication, idle time, the GEMM floor), the one breakdown of the step
the run reports. Everything lands in <run_dir>/profile/ and in MLflow.
"""
from __future__ import annotations

import json
import logging
import warnings
from pathlib import Path
from typing import Any

import torch
from torch.profiler import ProfilerActivity, profile, schedule

from src.profiling.anatomy import anatomy_from_trace, format_table
from src.profiling.stderr_lines import DroppedLines

log = logging.getLogger("src.profile")


class TorchProfileSession:
    def __init__(self, wait: int, warmup: int, active: int, record_shapes: bool, profile_memory: bool, with_stack: bool, row_limit: int,
                 flops_per_step: float | None = None, gemm_peak_tflops: float = 790.0):
        self.wait, self.warmup, self.active = wait, warmup, active
        self.flops_per_step, self.gemm_peak_tflops = flops_per_step, gemm_peak_tflops
        self.anatomy: dict[str, Any] | None = None
        self.record_shapes, self.profile_memory, self.with_stack = record_shapes, profile_memory, with_stack
        self.row_limit = row_limit
        self.results: dict[str, Any] = {}
        self.artifacts: list[Path] = []
        self._prof = None
        self._quiet: DroppedLines | None = None

    def start(self, device: torch.device, rank: int, out_dir: Path | None) -> None:
        self.device, self.rank, self.out_dir = device, rank, out_dir
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
        self._prof = profile(
            activities=activities,
            schedule=schedule(wait=self.wait, warmup=self.warmup, active=self.active, repeat=1),
            record_shapes=self.record_shapes,
            profile_memory=self.profile_memory,
            with_stack=self.with_stack,
            on_trace_ready=self._on_trace_ready,
        )
        if self.profile_memory and device.type == "cuda":
            # The caching allocator's own history: what torch.profiler's memory timeline is deprecated for.
            torch.cuda.memory._record_memory_history(max_entries=200_000)
        # Kineto's USDT start/stop markers and c10's "Memory block of unknown size" warning, written by
        # C++ to stderr in every rank: left out, nothing else (src/profiling/stderr_lines.py)
        self._quiet = DroppedLines().__enter__()
        self._prof.__enter__()

    def step(self) -> None:
        self._prof.step()

    def stop(self) -> None:
        try:
            if self._prof is not None:
                self._prof.__exit__(None, None, None)
                self._prof = None
        finally:
            if self._quiet is not None:
                self._quiet.__exit__(None, None, None)
                self._quiet = None

    def _on_trace_ready(self, prof) -> None:
        if self.out_dir is None:
            return
        self.out_dir.mkdir(parents=True, exist_ok=True)
        trace = self.out_dir / f"trace_rank{self.rank}.json"
        prof.export_chrome_trace(str(trace))
        self.artifacts.append(trace)
        if self.rank != 0:
            return
        on_device = self.device.type == "cuda"
        averages = prof.key_averages()
        sort = "self_device_time_total" if on_device else "self_cpu_time_total"
        table = averages.table(sort_by=sort, row_limit=self.row_limit)
        (self.out_dir / "key_averages.txt").write_text(table + "\n")
        self.results = {
            "profiled_steps": self.active,
            "time_source": "device kernels" if on_device else "cpu ops (self time)",
            "top_ops": [
                {"name": e.key, "calls": e.count, "self_time_s": (e.self_device_time_total if on_device else e.self_cpu_time_total) * 1e-6}
                for e in sorted(averages, key=lambda e: -(e.self_device_time_total if on_device else e.self_cpu_time_total))[: self.row_limit]
                if not e.key.startswith("ProfilerStep")
            ],
        }
        self.artifacts.append(self.out_dir / "key_averages.txt")
        # read back from the trace just written: the same numbers `python -m src.profiling.anatomy TRACE` gives
        self.anatomy = anatomy_from_trace(json.loads(trace.read_text()), self.flops_per_step, self.gemm_peak_tflops)
        self.results["anatomy"] = self.anatomy
        (self.out_dir / "anatomy.json").write_text(json.dumps(self.anatomy, indent=2))
        self.artifacts.append(self.out_dir / "anatomy.json")
        if self.profile_memory and on_device:
            snapshot = self.out_dir / "memory_snapshot_rank0.pickle"  # drag into pytorch.org/memory_viz
            torch.cuda.memory._dump_snapshot(str(snapshot))
            torch.cuda.memory._record_memory_history(enabled=None)
            self.artifacts.append(snapshot)
        elif self.profile_memory and self.with_stack:
            memory = self.out_dir / "memory_timeline.json"
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", FutureWarning)
                prof.export_memory_timeline(str(memory), device="cpu")
            self.artifacts.append(memory)
        elif self.profile_memory:
            log.info("a CPU memory timeline needs the allocation stacks: add profile.with_stack=true (traces grow ~10x)")
        log.info("profile: %d steps recorded in %s (a trace per rank, key_averages.txt, anatomy.json)", self.active, self.out_dir)
        log.info("key averages (by %s):\n%s", sort, table)
        log.info("%s", format_table(self.anatomy))
