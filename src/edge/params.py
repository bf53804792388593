"""Parameter archives (.irpa) for compiled edge modules, written with iree.runtime alone.

A compiled module names its parameters (scope "model", the module's state_dict keys, the zeroed
KV cache included); the archive holds their values. Writing it needs only iree-base-runtime and
torch, so a device that has no IREE compiler builds it from the seeded initialisation in about a
second (model=small in fp16: 90 MB) and only the code (.vmfb) has to travel.
"""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

SCOPE = "model"


def _host_bytes(tensor: torch.Tensor) -> np.ndarray:
    t = tensor.detach().contiguous().cpu()
    if t.dtype == torch.bfloat16:  # numpy has no bf16: the same 2 bytes as int16
        t = t.view(torch.int16)
    return t.numpy()


def write_params(lm: torch.nn.Module, irpa: Path) -> int:
    """Every parameter and persistent buffer of `lm` to `irpa`; returns its size in bytes."""
    import iree.runtime as rt

    index = rt.ParameterIndex()
    for name, tensor in lm.state_dict().items():
        if not torch.count_nonzero(tensor):  # the KV cache: a splat entry costs no bytes on disk
            index.add_splat(name, np.zeros(1, dtype=_host_bytes(tensor[:1]).dtype), tensor.numel() * tensor.element_size())
        else:
            index.add_buffer(name, _host_bytes(tensor).tobytes())
    irpa.parent.mkdir(parents=True, exist_ok=True)
    index.create_archive_file(str(irpa))
    return irpa.stat().st_size
