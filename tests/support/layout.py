"""Plugin: each test's layer, a marker from its folder (`pytest -m unit`), and the order the suite's
files run in under `-n 2 --dist loadfile` (CONTRIBUTING.md)."""
from __future__ import annotations

from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parents[1]
# tests/unit: in-process only; tests/integration: starts the project's own processes (CLI runs,
# ranks); tests/system: starts real services or whole journeys (MLflow server, PostgreSQL, SLURM,
# Chromium, IREE on lavapipe, preemption drills)
LAYERS = ("unit", "integration", "system")

# The longest test files first (seconds on one worker of a 2-core machine, the 120 slowest of
# `--durations`, 2026-12-05; test_fp8.py after its float8 cases shrank):
# under `-n 2 --dist loadfile` a file runs whole on one worker, and a long file taken up
# last leaves the other worker idle at the end; longest first is the classic cure. The order of
# tests inside a file, and of the files not named, is unchanged.
LONGEST_FIRST = {"test_edge.py": 380, "test_slurm.py": 338, "test_checkpoint.py": 337, "test_preemption.py": 191, "test_train_e2e.py": 169,
                 "test_tracking_sync.py": 162, "test_mlflow_server.py": 156, "test_edge_quant.py": 140, "test_llama3.py": 125,
                 "test_edge_sweep.py": 117, "test_fp8.py": 115, "test_kernel_adamw.py": 105, "test_sweeps.py": 104,
                 "test_cluster_postgres.py": 96, "test_multinode.py": 92, "test_edge_shapes.py": 90}


class Misplaced(pytest.File):
    """A test file outside the three layers (one merged from before the split, or a new one put
    beside them): an error that names where it goes, instead of its tests."""

    def collect(self):
        raise self.CollectError(f"{self.path.relative_to(TESTS.parent)}: a test file goes in tests/unit, tests/integration or "
                                "tests/system, by what it starts (CONTRIBUTING.md, Running the tests)")


def pytest_pycollect_makemodule(module_path: Path, parent):
    if TESTS in module_path.parents and not (module_path.parent.parent == TESTS and module_path.parent.name in LAYERS):
        return Misplaced.from_parent(parent, path=module_path)
    return None


def pytest_configure(config):
    # pytest-xdist's file scheduler sorts the files by their number of tests, most first, unless told
    # not to (xdist 3.8, LoadScopeScheduling.schedule), which undid the order below: test_edge_sweep.py,
    # one test and about 90 s of IREE compiles, ran last and alone in two clean-clone runs of .ci/run,
    # the other worker idle. --no-loadscope-reorder, set here so CONTRIBUTING's command keeps it.
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before `-m` deselects by marker
def pytest_collection_modifyitems(config, items):
    for item in items:
        folder = item.path.parent
        if folder.parent == TESTS and folder.name in LAYERS:
            item.add_marker(folder.name)
    items.sort(key=lambda item: -LONGEST_FIRST.get(item.path.name, 0))  # a stable sort: each file's own order kept
