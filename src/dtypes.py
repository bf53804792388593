"""The one table from the dtype names in the configs to torch dtypes.

precision.* and kernel_bench.dtype spell a dtype as torch does (`bfloat16`); edge.dtype uses the
short names of inference runtimes (`bf16`), which IREE's and the edge sweep's tables key on too.
"""
from __future__ import annotations

import torch

TORCH_DTYPES: dict[str, torch.dtype] = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
SHORT_NAMES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""edge.dtype's names -> torch's"""


def torch_dtype(name: str) -> torch.dtype:
    """`bfloat16` or `bf16` -> torch.bfloat16."""
    return TORCH_DTYPES[SHORT_NAMES.get(name, name)]
