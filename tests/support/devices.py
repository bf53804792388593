"""Plugin: what a test needs of the machine, said once for the suite.

Triton kernels run in Triton's interpreter where there is no GPU; the variable must be set before
any @triton.jit is applied, so before kernels/triton is imported: this plugin is registered first
(tests/conftest.py), before any test module is collected."""
from __future__ import annotations

import os

import pytest
import torch as _torch

if not _torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# needs_gpu asks is_available() alone: reading the capability runs torch.cuda's lazy init, after
# which a forked child of this process refuses CUDA, so only the files that ask for a capability read it.
needs_gpu = pytest.mark.skipif(not _torch.cuda.is_available(), reason="needs an NVIDIA GPU")


def needs_capability(major: int, minor: int, reason: str) -> pytest.MarkDecorator:
    """Skips unless GPU 0 is of compute capability (major, minor) or newer; `reason` says what needs it."""
    ok = _torch.cuda.is_available() and _torch.cuda.get_device_capability() >= (major, minor)
    return pytest.mark.skipif(not ok, reason=reason)
