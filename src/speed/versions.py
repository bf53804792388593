"""The torch and Triton releases a recipe is checked against: `major.minor`, read at call time (a
test patches `torch.__version__`; a wheel's local tag, `+cu130` or `+cpu`, and a patch release do
not change FSDP2's or Inductor's internals, a minor release does)."""
from __future__ import annotations

import re

import torch

TORCH_TESTED = ("2.11", "2.13", "2.14", "2.15")
"""the torch releases every recipe's parity test passed on: 2.11.0 (the GPU image), 2.13.0 (CI's
suite), 2.14.1, 2.15.0 (CI's second environment); 2.12 was never installed here"""
TRITON_TESTED = ("3.6", "3.8", "3.9")
"""the Triton releases beside them: 3.6 (torch 2.11, compiled on a GPU), 3.8 (2.14.1) and 3.9
(2.13.0 and 2.15.0), in Triton's interpreter on a CPU"""


def release(version: str) -> str:
    """'2.15.0+cu132' -> '2.15'; '2.16.0.dev20261201' -> '2.16'; a string with no such prefix, whole."""
    found = re.match(r"(\d+)\.(\d+)", version)
    return f"{found.group(1)}.{found.group(2)}" if found else version


def torch_version() -> str:
    return str(torch.__version__)


def triton_version() -> str | None:
    """The installed Triton's version; None where Triton is missing."""
    try:
        import triton
    except ImportError:
        return None
    return str(triton.__version__)
