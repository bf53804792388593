"""src/profiling/gpu_clocks.py: the clock and power figures from NVML samples, the log line, no sampler
without a GPU; on a GPU, the sampler over a busy stretch started by the step callback."""
from __future__ import annotations

import time
from types import SimpleNamespace

import pytest
import torch

from src.profiling.gpu_clocks import FIGURES, HW_THERMAL, SW_POWER_CAP, ClockSampler, Sample, describe, summarize
from tests.support.devices import needs_gpu


def test_the_figures_are_medians_and_shares_of_the_samples():
    # ten samples of a step at its power cap (two of them also thermally slowed), as an H200 gave them
    clocks = [1605, 1665, 1440, 1635, 1500, 1680, 1620, 1575, 1545, 1980]
    reasons = [SW_POWER_CAP] * 9 + [0]
    reasons[2] |= HW_THERMAL
    reasons[4] |= HW_THERMAL
    samples = [Sample(c, 690.0 + i, r) for i, (c, r) in enumerate(zip(clocks, reasons, strict=True))]
    f = summarize(samples, 1980, 700.0)
    assert set(f) == set(FIGURES)
    assert f["gpu_sm_clock_mhz"] == 1612.5 and f["gpu_sm_clock_low_mhz"] == 1440  # median of ten; the 10th percentile's sample
    assert f["gpu_sm_clock_max_mhz"] == 1980 and f["gpu_power_limit_w"] == 700.0 and f["gpu_power_w"] == 694.5
    assert f["gpu_power_capped_frac"] == 0.9 and f["gpu_thermal_frac"] == 0.2 and f["gpu_clock_samples"] == 10
    assert describe(f) == ("SM clock 1612 MHz median (1440 at the 10th percentile, 1980 max), 694 W of 700, the power cap held the "
                           "clock in 90% of samples, a thermal or forced slowdown in 20%")
    # nothing held the clock: neither share is written out
    calm = summarize([Sample(1980, 300.0, 0)] * 3, None, None)
    assert describe(calm) == "SM clock 1980 MHz median (1980 at the 10th percentile), 300 W"
    assert summarize([], 1980, 700.0) is None


def test_no_sampler_where_there_is_no_gpu_to_sample():
    assert ClockSampler.for_device(torch.device("cpu"), 0.1) is None
    if not torch.cuda.is_available():  # pynvml imports, and NVML's library is not there
        assert ClockSampler.for_device(torch.device("cuda", 0), 0.1) is None
    else:
        assert ClockSampler.for_device(torch.device("cuda", 0), 0.0) is None  # 0: off


@pytest.mark.gpu
@needs_gpu
def test_the_sampler_reads_a_busy_gpu_from_the_step_it_is_told():
    sampler = ClockSampler.for_device(torch.device("cuda", torch.cuda.current_device()), 0.02)
    assert sampler is not None and sampler.max_sm_mhz > 0 and sampler.power_limit_w > 0
    # the untimed steps are 0-9, read every 10th step (train.log_every=10): sampling starts once step 9 is read
    on_step = sampler.start_after(9)
    on_step(SimpleNamespace(step=8))  # a run that reads every step: step 8 read, not yet
    assert sampler._thread is None and not sampler.samples
    on_step(SimpleNamespace(step=9))
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < 1.0:
        for _ in range(20):
            a = (a @ a).clamp_(-1, 1)
        torch.cuda.synchronize()
    f = sampler.stop()
    assert sampler._thread is None and f["gpu_clock_samples"] >= 10
    assert 0 < f["gpu_sm_clock_low_mhz"] <= f["gpu_sm_clock_mhz"] <= f["gpu_sm_clock_max_mhz"]
    assert 0 < f["gpu_power_w"] and 0 <= f["gpu_power_capped_frac"] <= 1 and 0 <= f["gpu_thermal_frac"] <= 1


@pytest.mark.gpu
@needs_gpu
def test_a_run_reports_its_clock_over_the_timed_steps_read_every_tenth(tmp_path):
    """+exp=fsdp4_tuned reads every 10th step: with 10 untimed steps, the sampler starts when step 9 is read
    (counting reads instead, it waited for a 10th read that a 30-step run never makes)."""
    from tests.support.cli import read_summary, run_cli

    proc = run_cli(["+exp=fsdp4_tuned", "dist.nproc=1", "model=small", "train.steps=30", "train.untimed_steps=10",
                    "train.gpu_clock_interval_s=0.01", "tracking=none"], cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    s = read_summary(tmp_path)
    assert s["gpu_clock_samples"] >= 3 and 0 < s["gpu_sm_clock_mhz"] <= s["gpu_sm_clock_max_mhz"], s
    assert "GPU over the timed steps: SM clock" in (next(tmp_path.glob("outputs/*/*/run.log"))).read_text()
