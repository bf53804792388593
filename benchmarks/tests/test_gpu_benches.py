"""The GPU benches (marked `gpu`, skipped without CUDA) over one-GPU runs of the seed's step."""
from __future__ import annotations

from pathlib import Path

import pytest

from tests.support.cli import run_cli
from tests.support.devices import needs_gpu

pytestmark = [pytest.mark.gpu, needs_gpu]


def test_the_seed_steps_steady_steps_make_no_host_sync(tmp_path: Path):
    """benchmarks.step_syncs over a one-GPU run of the seed's step (small model): from step 3 on,
    torch's sync debugging counts nothing, logged steps included (train.log_every=1)."""
    proc = run_cli(["--after", "3", "--", "+exp=fsdp4", "model=small", "dist.nproc=1", "train.steps=6", "tracking=none"],
                   cwd=tmp_path, timeout=600, module="benchmarks.step_syncs")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "syncs from step 3 on: 0" in proc.stdout


def test_host_phases_splits_a_steps_host_and_device_time(tmp_path: Path):
    """benchmarks.host_phases over a one-GPU run (small model): a table of host and device ms for
    forward, backward, optimizer and the loop's own work, each positive, over the steps from --after."""
    proc = run_cli(["--after", "2", "--", "+exp=fsdp4", "model=small", "dist.nproc=1", "train.steps=6", "tracking=none"],
                   cwd=tmp_path, timeout=600, module="benchmarks.host_phases")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "medians over 4 steps" in proc.stdout
    rows = {line.split("|")[1].strip(): line.split("|")[2:4] for line in proc.stdout.splitlines() if line.startswith("| ") and "phase" not in line}
    assert set(rows) == {"forward", "backward", "optimizer", "rest", "step"}
    assert all(float(host) > 0 for host, _ in rows.values())
    assert all(float(dev) > 0 for name, (_, dev) in rows.items() if name != "rest")
