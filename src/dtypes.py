"""The one table from the dtype names in the configs to torch dtypes, and the names as schema choices.

precision.* and kernel_bench.dtype spell a dtype as torch does (`bfloat16`); edge.dtype uses the
short names of inference runtimes (`bf16`), which IREE's and the edge sweep's tables key on too.
"""
from __future__ import annotations

from enum import StrEnum
from functools import cache
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Dtype(StrEnum):
    """precision.param_dtype / reduce_dtype, kernel_bench.dtype"""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ShortDtype(StrEnum):
    """edge.dtype"""

    fp32 = "fp32"
    fp16 = "fp16"
    bf16 = "bf16"


SHORT_NAMES: dict[str, str] = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}
"""edge.dtype's names -> torch's"""


def torch_dtype(name: str) -> torch.dtype:
    """`bfloat16` or `bf16` -> torch.bfloat16."""
    return _torch_dtypes()[SHORT_NAMES.get(name, name)]


@cache
def _torch_dtypes() -> dict[str, torch.dtype]:
    # built on first use: the schemas import this module for Dtype, and `--help` or `--cfg job`
    # should not pay for importing torch
    import torch

    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def __getattr__(name: str):
    if name == "TORCH_DTYPES":  # the names -> torch dtypes, as _torch_dtypes builds them
        return _torch_dtypes()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
