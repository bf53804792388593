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

# The longest test files first (seconds on one worker, the suite under `-n 2 --dist loadfile` on the
# 2-core machine, 2026-12-07, a loaded machine: the order is what counts): a file runs whole on one
# worker, and a long file taken up last leaves the other worker idle at the end; longest first is the
# classic cure. The files not named follow by layer, system, integration, the lab's, unit (the
# shortest last); the order of tests inside a file is unchanged.
LONGEST_FIRST = {"test_edge.py": 487, "test_preemption.py": 471, "test_checkpoint.py": 424, "test_slurm.py": 387, "test_train_e2e.py": 345,
                 "test_tracking_sync.py": 166, "test_llama3.py": 133, "test_edge_quant.py": 126, "test_sweeps.py": 104,
                 "test_kernel_adamw.py": 101, "test_edge_sweep.py": 96, "test_edge_shapes.py": 75, "test_mlflow_server.py": 75,
                 "test_edge_benches.py": 71, "test_multinode.py": 63, "test_cluster_postgres.py": 62, "test_optuna_sweep.py": 56}
LAYER_ORDER = {"system": 0, "integration": 1, "unit": 3}  # anything else (benchmarks/tests): 2


def _order(item) -> tuple[int, int]:
    folder = item.path.parent
    layer = LAYER_ORDER.get(folder.name, 2) if folder.parent == TESTS else 2
    return -LONGEST_FIRST.get(item.path.name, 0), layer


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
    # not to (xdist 3.8, LoadScopeScheduling.schedule), which undid the order above: test_edge_sweep.py,
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
    items.sort(key=_order)  # a stable sort: each file's own order kept
