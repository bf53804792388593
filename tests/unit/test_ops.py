"""The op table (src/fusion/ops.py): every row complete, and the one place that lists the ops."""
from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

from src.fusion.ops import BENCHES, OPS, load

ROOT = Path(__file__).resolve().parents[2]
NAMES = {op.name for op in OPS} | {b.name for b in BENCHES}


def _refs(op) -> list[str]:
    swaps = [s for s in (op.triton, op.compiled) if s is not None]
    benches = [ref for b in op.benches for ref in (b.make, b.eager, b.triton, b.liger)]
    return [ref for ref in (*[s.modules for s in swaps], *[s.loss for s in swaps], *benches, op.measured) if ref]


@pytest.mark.parametrize("op", OPS, ids=lambda op: op.name)
def test_every_op_has_a_kernel_a_case_a_diagnosis_and_a_default(op):
    from src.config.tasks import KernelBenchConfig

    assert op.kernel.startswith("perflab_kernels.triton.")  # the folder kernels/triton/, installed under that name
    assert (ROOT / "kernels" / "triton" / (op.kernel.rsplit(".", 1)[1] + ".py")).is_file(), op.kernel
    # a case: timed alone by task=kernel_bench, or as the model uses it by kernels=auto
    assert op.benches or op.measured
    if op.triton is not None:
        assert op.benches, "a swap of the model has a bench against its reference"
    # a diagnosis reaches it: through its own profiled kernels, or through an op it replaces
    reached = {o.name for o in OPS if o.diagnosed}
    assert op.diagnosed or set(op.replaces) & reached
    defaults = KernelBenchConfig()
    for b in op.benches:
        assert b.name in defaults.ops and defaults.shapes[b.name], b.name
        assert all(len(shape) == len(b.dims) for shape in b.shapes)
    # every named piece of code is there (the Liger factories import Liger-Kernel only when called)
    for ref in _refs(op):
        if ref.startswith("kernels.") and importlib.util.find_spec("triton") is None:
            continue  # the kernels import triton (tests/unit/test_kernel_*.py skip without it too)
        assert callable(load(ref)), ref


def test_names_are_unique():
    names = [op.name for op in OPS]
    benches = [b.name for b in BENCHES]
    assert len(set(names)) == len(names) and len(set(benches)) == len(benches)
    assert all(r in names for op in OPS for r in op.replaces)


@pytest.mark.parametrize("bench", BENCHES, ids=lambda b: b.name)
def test_every_bench_case_runs_its_reference(bench):
    import torch

    from src.fusion.cases import _eager, make_case, output_of, seed

    shape = [4, 8, 16][: len(bench.dims)]
    case = make_case(bench.name, shape)
    seed("cpu")
    inputs = case.inputs(torch.device("cpu"), torch.float32, False)
    out = output_of(_eager(bench.name)(*inputs))
    assert torch.isfinite(out).all()


def _op_lists(path: Path) -> list[str]:
    """Literal lists, tuples, sets and dict keys in `path` that spell three or more distinct op names."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(node, ast.List | ast.Tuple | ast.Set) else []
        named = [i.value for i in items if isinstance(i, ast.Constant) and i.value in NAMES]
        if len(set(named)) >= 3:
            found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {', '.join(named)}")
    return found


def test_no_module_lists_the_ops_but_the_table():
    table = ROOT / "src" / "fusion" / "ops.py"
    found = [line for path in sorted((ROOT / "src").glob("**/*.py")) if path != table for line in _op_lists(path)]
    assert not found, "list the ops in src/fusion/ops.py only:\n" + "\n".join(found)
