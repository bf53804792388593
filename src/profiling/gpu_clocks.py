"""The GPU's SM clock, power draw and what held the clock down, sampled through NVML while a run's
timed steps go on.

A kernel's time depends on the clock it ran at, and a step that keeps the GPU busy runs at its
power cap: the float8 step (`+exp=fsdp4_fp8`) drew nearly all of its power limit with the SM clock
well below its maximum and the power-cap reason set in every sample; its kernels took longer
replayed back to back from graphs than launched with the device idle between them. So two runs
compare fairly only at the same clock, and a step
already at its power cap gains from fewer joules (bytes moved, FLOPs at lower precision) rather than
from overlap alone. MLflow's system metrics log the power draw but not the clock or its reasons;
this reads them (nvidia-ml-py, as torch.cuda.clock_rate and MLflow do).

    sampler = ClockSampler.for_device(torch.device("cuda", 0), interval_s=0.1)
    sampler.start(); ...; figures = sampler.stop()   # summarize()'s dict, or None
"""
from __future__ import annotations

import statistics
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# NVML's clock-event reasons (nvmlClocksEventReason*): the power cap, and the slowdowns that
# thermal limits or a power brake force. The values are NVML's, fixed by its C API.
SW_POWER_CAP = 0x4
HW_SLOWDOWN = 0x8
SW_THERMAL = 0x20
HW_THERMAL = 0x40
HW_POWER_BRAKE = 0x80
THERMAL_OR_FORCED = HW_SLOWDOWN | SW_THERMAL | HW_THERMAL | HW_POWER_BRAKE


@dataclass(frozen=True)
class Sample:
    sm_mhz: float
    power_w: float
    reasons: int  # NVML's clock-event reason bits at the sample


FIGURES = ("gpu_sm_clock_mhz", "gpu_sm_clock_low_mhz", "gpu_sm_clock_max_mhz", "gpu_power_w", "gpu_power_limit_w",
           "gpu_power_capped_frac", "gpu_thermal_frac", "gpu_clock_samples")


def summarize(samples: list[Sample], max_sm_mhz: float | None, power_limit_w: float | None) -> dict[str, Any] | None:
    """Medians and shares over the samples (None when there are none): `gpu_sm_clock_mhz` the median SM
    clock and `gpu_sm_clock_low_mhz` its 10th percentile, `gpu_sm_clock_max_mhz` the device's highest,
    `gpu_power_w` the median draw against `gpu_power_limit_w`, `gpu_power_capped_frac` the share of
    samples whose clock the power cap held, `gpu_thermal_frac` the share a thermal or forced slowdown
    held, `gpu_clock_samples` how many."""
    if not samples:
        return None
    clocks = sorted(s.sm_mhz for s in samples)
    n = len(samples)
    return {
        "gpu_sm_clock_mhz": statistics.median(clocks),
        "gpu_sm_clock_low_mhz": clocks[int(0.1 * (n - 1))],
        "gpu_sm_clock_max_mhz": max_sm_mhz,
        "gpu_power_w": statistics.median(s.power_w for s in samples),
        "gpu_power_limit_w": power_limit_w,
        "gpu_power_capped_frac": sum(bool(s.reasons & SW_POWER_CAP) for s in samples) / n,
        "gpu_thermal_frac": sum(bool(s.reasons & THERMAL_OR_FORCED) for s in samples) / n,
        "gpu_clock_samples": n,
    }


def describe(figures: dict[str, Any]) -> str:
    """One line for the log: 'SM clock 1605 MHz median (1485 at the 10th percentile, 1980 max), 692 W
    of 700, the power cap held the clock in 98% of samples'."""
    top = figures.get("gpu_sm_clock_max_mhz")
    limit = figures.get("gpu_power_limit_w")
    line = (f"SM clock {figures['gpu_sm_clock_mhz']:.0f} MHz median ({figures['gpu_sm_clock_low_mhz']:.0f} at the 10th percentile"
            f"{f', {top:.0f} max' if top else ''}), {figures['gpu_power_w']:.0f} W{f' of {limit:.0f}' if limit else ''}")
    if figures["gpu_power_capped_frac"]:
        line += f", the power cap held the clock in {100 * figures['gpu_power_capped_frac']:.0f}% of samples"
    if figures["gpu_thermal_frac"]:
        line += f", a thermal or forced slowdown in {100 * figures['gpu_thermal_frac']:.0f}%"
    return line


class ClockSampler:
    """Samples one GPU every `interval_s` on a daemon thread between start() and stop(). Each sample
    is three NVML queries (~tens of microseconds of host time, off the training thread but under its
    GIL: at the default 0.1 s, well under 0.1% of a step's host time)."""

    def __init__(self, nvml: Any, handle: Any, interval_s: float):
        self.nvml, self.handle, self.interval_s = nvml, handle, interval_s
        self.samples: list[Sample] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self.max_sm_mhz = self._query(lambda: nvml.nvmlDeviceGetMaxClockInfo(handle, nvml.NVML_CLOCK_SM))
        limit = self._query(lambda: nvml.nvmlDeviceGetEnforcedPowerLimit(handle))
        self.power_limit_w = limit / 1e3 if limit is not None else None

    def _query(self, call):
        try:
            return call()
        except self.nvml.NVMLError:  # a query this GPU or driver does not support
            return None

    @classmethod
    def for_device(cls, device: torch.device, interval_s: float) -> ClockSampler | None:
        """A sampler of `device`'s GPU, or None where there is none to sample (not CUDA, no NVML
        library or Python binding, a GPU NVML does not know)."""
        if device.type != "cuda" or interval_s <= 0:
            return None
        try:
            import pynvml as nvml
        except ImportError:
            return None
        try:
            nvml.nvmlInit()
            # by UUID, so CUDA_VISIBLE_DEVICES' renumbering cannot point at another GPU
            uuid = str(torch.cuda.get_device_properties(device).uuid)
            handle = nvml.nvmlDeviceGetHandleByUUID(uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}")
        except nvml.NVMLError:
            return None
        return cls(nvml, handle, interval_s)

    def sample(self) -> Sample | None:
        nvml, h = self.nvml, self.handle
        try:
            return Sample(nvml.nvmlDeviceGetClockInfo(h, nvml.NVML_CLOCK_SM), nvml.nvmlDeviceGetPowerUsage(h) / 1e3,
                          nvml.nvmlDeviceGetCurrentClocksEventReasons(h))
        except nvml.NVMLError:
            return None

    def _run(self) -> None:
        while not self._stop.is_set():
            s = self.sample()
            if s is not None:
                self.samples.append(s)
            self._stop.wait(self.interval_s)

    def start(self) -> None:
        if self._thread is None:
            self._stop.clear()  # a sampler stopped before samples again, adding to what it has
            self._thread = threading.Thread(target=self._run, name="gpu-clocks", daemon=True)
            self._thread.start()

    def start_after(self, step: int) -> Callable[[Any], None]:
        """A step callback (train_loop's on_step, given each read step's StepStats) that starts sampling
        once step `step` has been read: the last untimed one, so the samples cover the timed steps. Steps
        are read every train.log_every, so it counts their numbers, not the reads. Below 0 it starts now."""

        def on_step(stats: Any) -> None:
            if stats.step >= step:
                self.start()

        if step < 0:
            self.start()
        return on_step

    def stop(self) -> dict[str, Any] | None:
        """Stops sampling; summarize() over what was sampled."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None
        return summarize(self.samples, self.max_sm_mhz, self.power_limit_w)

