"""optim.schedule: the learning rate per step, and its settings checked before anything starts."""
from __future__ import annotations

import math

import pytest

from src.config.compose import ConfigError, compose_config
from src.config.validate import validate
from src.train.schedule import lr_at


def test_constant_is_the_seeds_and_warms_up_only_when_asked():
    assert [lr_at(s, 1e-3, "constant", 0, 10) for s in (0, 5, 9)] == [1e-3] * 3
    assert [lr_at(s, 1e-3, "constant", 4, 10) for s in range(6)] == pytest.approx([2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3])


def test_cosine_rises_over_the_warmup_then_falls_to_the_floor_at_the_last_step():
    lrs = [lr_at(s, 1.0, "cosine", 5, 105, min_lr_ratio=0.1) for s in range(105)]
    assert lrs[0] == pytest.approx(0.2) and lrs[4] == pytest.approx(1.0) and lrs[5] == pytest.approx(1.0)
    assert all(a >= b for a, b in zip(lrs[5:], lrs[6:]))  # never rises after the warm-up
    assert lrs[55] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 50 / 99)))
    assert lrs[-1] == pytest.approx(0.1)


@pytest.mark.parametrize("override,needle", [
    ("optim.schedule=cosin", "optim.schedule"),
    ("optim.warmup_steps=-1", "optim.warmup_steps=-1"),
    ("optim.min_lr_ratio=2", "optim.min_lr_ratio=2"),
])
def test_bad_schedule_settings_are_refused_when_composed(override, needle):
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        validate(compose_config([override]), cuda_device_count=0, mps_available=False)
