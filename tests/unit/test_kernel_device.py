"""kernels/triton/device.py's constant_for_compile: torch.compiler.assume_constant_result's mark
without its import of torch._dynamo (on the torch installed: 2.13 here, 2.15 in .ci/torch_latest.sh)."""
from __future__ import annotations

import os
import sys

import torch

from perflab_kernels.triton.device import MARKED_CONSTANT, constant_for_compile
from tests.support.cli import REPO


def test_the_mark_is_what_torchs_decorator_sets():
    def ours() -> int:
        return 1

    def theirs() -> int:
        return 1

    torch.compiler.assume_constant_result(theirs)  # imports torch._dynamo
    marked = vars(theirs)
    assert marked == {MARKED_CONSTANT: True}, marked
    saved = sys.modules.pop("torch._dynamo")
    try:
        constant_for_compile(ours)  # Dynamo not loaded: the attribute alone
    finally:
        sys.modules["torch._dynamo"] = saved
    assert vars(ours) == marked


def test_dynamo_calls_a_marked_function_instead_of_tracing_it():
    """A function Dynamo cannot trace (os.listdir) compiles into one graph when marked: its answer is a constant."""
    def answer(i: int) -> int:
        return len(os.listdir(REPO)) * 0 + 3 + i

    saved = sys.modules.pop("torch._dynamo")
    try:
        constant_for_compile(answer)
    finally:
        sys.modules["torch._dynamo"] = saved
    torch._dynamo.reset()
    compiled = torch.compile(lambda x: x * answer(1), backend="eager", fullgraph=True)
    assert torch.equal(compiled(torch.ones(3)), torch.full((3,), 4.0))

