"""Name a kernel's op and category from its (demangled) name, for both ncu records and
torch.profiler events. First match wins; the order puts specific patterns before generic ones."""
from __future__ import annotations

import re

# (op, category, pattern). Ops are what a remedy acts on (silu, mul, rms_norm); categories are
# the buckets of a step's time breakdown.
_RULES: list[tuple[str, str, str]] = [
    ("nccl", "communication", r"nccl|all_?gather|reduce_?scatter|all_?reduce|c10d::"),
    ("flash_attention", "attention", r"flash|fmha|efficient_attention|scaled_dot_product|_attention_(forward|backward)|cudnn.*sdpa|dot_do_o|convert_dq"),
    ("adamw", "optimizer", r"adam|multi_tensor_apply|_foreach_|fused_sgd|optimizer"),
    ("cross_entropy", "loss", r"cross_entropy|nll_loss|log_softmax"),
    ("softmax", "softmax", r"softmax"),
    ("rms_norm", "norm", r"rms_?norm|layer_?norm|group_?norm|batch_?norm|GammaBeta"),
    ("gemm", "gemm", r"nvjet|gemm|cutlass|xmma|sm\d+_.*(hmma|gmma)|ampere_|hopper_|cublas|matmul|\baddmm\b|\bmm\b|\bbmm\b|linear"),
    # float8 casts (kernels/triton/fp8_linear.py's _rowwise_e4m3 / _transposed_e4m3, torchao's): after
    # gemm, whose float8 CUTLASS kernels name e4m3 in their template arguments
    ("fp8_cast", "elementwise", r"e4m3|e5m2|float8|fp8"),
    ("silu", "elementwise", r"silu|swish"),
    ("gelu", "elementwise", r"gelu"),
    ("mul", "elementwise", r"MulFunctor|\bmul\b"),
    ("add", "elementwise", r"AddFunctor|CUDAFunctor_add|\badd\b"),
    ("copy", "elementwise", r"direct_copy|copy_kernel|\bcopy_?\b|\bto\b|_to_copy|cat_|CatArray"),
    ("reduce", "reduction", r"reduce_kernel|\bsum\b|\bmean\b|norm_kernel|linalg_vector_norm|lpnorm"),
    ("fill", "elementwise", r"fill|zero_|distribution|random|normal_kernel|uniform"),
    # embedding backward sorts and segments the token ids before it accumulates rows
    ("embedding", "gather", r"embedding|index_select|indexSelect|gather|scatter|RadixSort|DeviceScan|DeviceCompact|unique_by_key|grad_weight|partial_?segment|partials_per_segment"),
    ("elementwise", "elementwise", r"elementwise|vectorized|unrolled"),
]
_COMPILED = [(op, cat, re.compile(pat, re.I)) for op, cat, pat in _RULES]
CATEGORIES = ("gemm", "attention", "norm", "softmax", "elementwise", "loss", "optimizer", "communication", "reduction", "gather", "other")


def classify_op(kernel_name: str) -> tuple[str, str]:
    """(op, category) of a kernel, e.g. ('silu', 'elementwise'), ('gemm', 'gemm')."""
    for op, cat, pat in _COMPILED:
        if pat.search(kernel_name):
            return op, cat
    return "other", "other"
