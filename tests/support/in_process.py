"""Plugin: training in the test's own process, as a rank runs it (train_on_and_off), and the
`in_process_runs` fixture that puts back what such a run changes in the process."""
from __future__ import annotations

import json
from pathlib import Path

import pytest


def train_on_and_off(tmp_path: Path, overrides: list[str], knob: str) -> dict[str, tuple[dict, list[dict]]]:
    """The same run in this process (train(), as a rank runs it) with `knob`=on and then =off: for each,
    its summary.json and its metrics.jsonl's lines. Tests that call it take the in_process_runs fixture."""
    from src.config.compose import compose_config
    from src.runtime import RunContext
    from src.train.worker import train

    runs = {}
    for use in ("on", "off"):
        run_dir = tmp_path / use
        run_dir.mkdir()
        train(compose_config([*overrides, f"{knob}={use}"]), RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
        runs[use] = (json.loads((run_dir / "summary.json").read_text()),
                     [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()])
    return runs


@pytest.fixture
def in_process_runs():
    """train() sets up a rank's logging (handlers on the root logger) and Dynamo keeps what it
    compiled: both are put back after the test, for the tests that share this process."""
    import logging

    import torch

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in root.handlers:
        if handler not in handlers:
            handler.close()
    root.handlers[:] = handlers
    root.setLevel(level)
    root.__dict__.pop("_perflab_configured", None)
    torch._dynamo.reset()
