"""precision=fp8: float8 training through torchao (`torchao.float8`), the way torchtitan applies it,
or (precision.fp8_impl=triton) through kernels/triton/fp8_linear.py's casts.

Order (torchtitan's parallelize_llama): convert the plain model (on the meta device) first, then
torch.compile each block, then fully_shard. `convert_to_float8_training` swaps the transformer
blocks' nn.Linear for Float8Linear: their three GEMMs (output, grad input, grad weight) run as
float8 `torch._scaled_mm` with dynamic scales; the output head stays bf16, as torchtitan leaves
it (its logits go straight into the softmax, and it is 1 of the 49 linears of mini_llm). Under FSDP2 with the
tensorwise recipe the weights are all-gathered in float8 (`enable_fsdp_float8_all_gather`), and
their scales for the next step come from one all-reduce of every weight's amax right after the
optimizer step (`precompute_float8_dynamic_scale_for_fsdp`) instead of one per weight in forward.

torchao's float8 training is Python over torch._scaled_mm, so its C++ extensions (which warn when
built for another torch) are not needed. Without torch.compile each scale and cast is a separate
kernel: use kernels=compile for speed.
"""
from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch.nn as nn

TORCHAO_INSTALL = "pip install torchao==0.17.0 (or pip install -e \".[fp8]\")"
MIN_CAPABILITY = (8, 9)  # float8 tensor cores: Ada (8.9), Hopper (9.0), Blackwell (10.x)
_ALIGN = 16  # torch._scaled_mm needs every GEMM dimension a multiple of 16
# the recipes kernels/triton/fp8_linear.py casts for, and whether each runs the grad-weight GEMM in float8
TRITON_RECIPES = {"rowwise_with_gw_hp": False, "rowwise_with_gw_tensorwise": True}
TORCHAO_RECIPES = ("tensorwise", "rowwise", "rowwise_with_gw_hp")


def float8_dims(model_cfg, data_cfg) -> dict[str, int]:
    """Every size that reaches a float8 GEMM in a block: both sides of each of its nn.Linear layers
    (the width, the attention projections' widths, the MLP's hidden width) and the token count, the
    inner dimension of the grad-weight GEMM (grad_out^T @ input)."""
    from omegaconf import OmegaConf

    from src.models import meta_model

    block = meta_model(OmegaConf.merge(model_cfg, {"n_layers": 1})).layers[0]
    dims = {"model.dim": model_cfg.dim}
    for name, module in block.named_modules():
        if isinstance(module, nn.Linear):
            for size in (module.in_features, module.out_features):
                if size not in dims.values():
                    label = "the MLP's hidden width (model.ffn_hidden)" if name.startswith("ffn.") else f"the width of {name} (model={model_cfg.name})"
                    dims[label] = size
    dims["data.batch_size x data.seq_len"] = data_cfg.batch_size * data_cfg.seq_len
    return dims


def float8_refusal(backend: str, capability: tuple[int, int] | None, device_name: str, dims: dict[str, int], impl: str = "torchao",
                   recipe: str = "tensorwise") -> str | None:
    """Why precision=fp8 cannot run here, in one line naming the fix; None when it can.
    `capability` is the lowest compute capability among the visible GPUs (None: no GPU)."""
    if backend != "cuda":
        return (f"precision=fp8 runs float8 GEMMs on an NVIDIA GPU of compute capability 8.9+ (Ada, Hopper, Blackwell), "
                f"not on backend={backend}; use precision=bf16 here")
    if capability is not None and capability < MIN_CAPABILITY:
        return (f"precision=fp8 needs compute capability 8.9+ for float8 tensor cores; {device_name} is "
                f"{capability[0]}.{capability[1]}: use precision=bf16")
    if impl == "triton" and recipe not in TRITON_RECIPES:
        return (f"precision.fp8_impl=triton casts for {' or '.join(TRITON_RECIPES)}, not precision.fp8_recipe={recipe}; "
                f"set one of those or precision.fp8_impl=torchao")
    if impl == "torchao" and recipe not in TORCHAO_RECIPES:
        return f"precision.fp8_recipe={recipe} is cast by precision.fp8_impl=triton only; set that, or a recipe of torchao's ({', '.join(TORCHAO_RECIPES)})"
    if impl == "torchao" and importlib.util.find_spec("torchao") is None:
        return (f"precision=fp8 trains through torchao's float8, which is not installed: {TORCHAO_INSTALL} "
                "(or precision.fp8_impl=triton precision.fp8_recipe=rowwise_with_gw_hp)")
    why_not = _misaligned(dims)
    return f"precision=fp8: {why_not}; pick a size that is, or use precision=bf16" if why_not else None


def _misaligned(dims: dict[str, int]) -> str | None:
    """The first of `dims` (name -> size) that a float8 GEMM cannot take, as the start of a refusal; None when all can."""
    for what, size in dims.items():
        if size % _ALIGN:
            return f"{what} is {size}, not a multiple of {_ALIGN} (float8 GEMMs need every dimension a multiple of 16)"
    return None


def act_in_cast(precision, mlp: str) -> bool:
    """Whether the MLP's activation goes into its float8 casts (precision.fp8_act_in_cast), with
    fp8_impl=triton, wherever it can when unset: the seed's SiLU (model.mlp=silu) into the down
    projection's; SwiGLU (model.mlp=swiglu: the whole MLP as kernels/triton/fp8_swiglu.py's one
    function) with precision.fp8_recipe=rowwise_with_gw_tensorwise."""
    if not (precision.float8 and str(precision.fp8_impl) == "triton"):
        return False
    wanted = precision.fp8_act_in_cast is None or bool(precision.fp8_act_in_cast)
    if str(mlp) == "silu":
        return wanted
    return str(mlp) == "swiglu" and wanted and bool(TRITON_RECIPES.get(str(precision.fp8_recipe)))


def act_in_cast_refusal(precision, mlp: str) -> str | None:
    """Why precision.fp8_act_in_cast=true cannot apply, in one line naming the fix; None when it can
    (or is not asked for)."""
    if not precision.fp8_act_in_cast:
        return None
    if str(precision.fp8_impl) != "triton":
        return (f"precision.fp8_act_in_cast=true applies the MLP's activation inside kernels/triton's float8 casts; precision.fp8_impl="
                f"{precision.fp8_impl} casts elsewhere: set precision.fp8_impl=triton, or leave precision.fp8_act_in_cast unset")
    if str(mlp) not in ("silu", "swiglu"):
        return f"precision.fp8_act_in_cast=true folds model.mlp=silu or swiglu, not {mlp}: leave precision.fp8_act_in_cast unset"
    if str(mlp) == "swiglu" and not TRITON_RECIPES.get(str(precision.fp8_recipe)):
        return (f"precision.fp8_act_in_cast=true runs the SwiGLU MLP's grad-weight GEMMs on the float8 casts it writes (never the "
                f"bf16 activations); precision.fp8_recipe={precision.fp8_recipe} wants them in bf16: set precision.fp8_recipe="
                "rowwise_with_gw_tensorwise, or leave precision.fp8_act_in_cast unset")
    return None


def head_refusal(precision, fused: list[str], model_cfg) -> str | None:
    """Why precision.fp8_head=true cannot apply, in one line naming the fix; None when it can (or is not
    asked for). The float8 logits GEMM lives in kernels/triton's fused head and casts with fp8_linear's casts."""
    if not precision.fp8_head:
        return None
    if not precision.float8:
        return (f"precision.fp8_head=true runs the head's logits GEMM in float8, and precision={precision.name} trains none: set precision=fp8 "
                "precision.fp8_impl=triton, or precision.fp8_head=false")
    if str(precision.fp8_impl) != "triton":
        return (f"precision.fp8_head=true casts the head with kernels/triton's float8 casts; precision.fp8_impl={precision.fp8_impl} casts "
                "elsewhere: set precision.fp8_impl=triton, or precision.fp8_head=false")
    if "linear_cross_entropy" not in fused:
        return (f"precision.fp8_head=true runs in the fused head and loss, and kernels.fused={list(fused)} leaves them apart: add "
                "linear_cross_entropy to kernels.fused, or set precision.fp8_head=false")
    why_not = _misaligned({"model.dim": model_cfg.dim, "model.vocab_size": model_cfg.vocab_size})
    return f"precision.fp8_head=true: {why_not}; set precision.fp8_head=false" if why_not else None


def float8_head(model: nn.Module) -> bool:
    """Set the fused head's logits GEMM to float8 (precision.fp8_head); whether the model has that head."""
    from perflab_kernels.triton.linear_cross_entropy import LinearCrossEntropyHead

    head = getattr(model, "head", None)
    if not isinstance(head, LinearCrossEntropyHead):
        return False
    head.float8 = True
    return True


def gathers_float8(precision, strategy: str) -> bool:
    """Whether the weights are torchao's float8 wrapper tensors, all-gathered in float8: tensorwise
    scales under FSDP2 (or HSDP) with precision.fp8_all_gather. Otherwise they stay plain bf16
    parameters and only the GEMMs see float8."""
    return bool(precision.float8 and precision.fp8_impl == "torchao" and precision.fp8_all_gather and precision.fp8_recipe == "tensorwise"
                and strategy in ("fsdp2", "hsdp"))


def is_block_linear(module: nn.Module, fqn: str) -> bool:
    """The module filter: nn.Linear inside `layers.N` (the transformer blocks); the head and any
    fused head (kernels.fused linear_cross_entropy) stay as they are."""
    return isinstance(module, nn.Linear) and fqn.startswith("layers.")


def convert_blocks_to_float8(model: nn.Module, recipe: str, fsdp_float8_all_gather: bool, emulate: bool = False, impl: str = "torchao",
                             module_filter: Callable[[nn.Module, str], bool] = is_block_linear, fold_activation: bool = False,
                             fast_accum: bool = False) -> int:
    """Swap the blocks' nn.Linear for a float8 linear in place; returns how many were swapped.
    impl=torchao: torchao's Float8Linear, where `emulate` runs the float8 GEMMs as casts + a
    high-precision matmul (tests on a CPU only). impl=triton: kernels/triton/fp8_linear.py's
    Float8RowwiseLinear (its class swapped in, the parameters kept), whose GEMMs are real float8
    wherever torch._scaled_mm runs (CUDA 8.9+, and a CPU). `module_filter(module, fqn)` picks the
    linears: those under `layers.` of the model; kernels=auto's timed block takes all of its own.
    `fold_activation` (impl=triton): each SiLU MLP's activation then runs inside its down
    projection's casts (fp8_linear.fold_mlp_activation), and each SwiGLU MLP as one function
    (fp8_swiglu.fold_swiglu); act_in_cast says when. `fast_accum` (precision.fp8_fast_accum): the
    grad-input and grad-weight GEMMs with fast accumulation too, not only the output GEMM."""
    if impl == "triton":
        from perflab_kernels.triton.fp8_linear import fold_mlp_activation, swap_to_float8
        from perflab_kernels.triton.fp8_swiglu import fold_swiglu
        from src.models.layers import SwiGLUFeedForward

        if str(recipe) not in TRITON_RECIPES:
            raise ValueError(f"precision.fp8_impl=triton casts for {' or '.join(TRITON_RECIPES)}, not {recipe}")
        linears = [m for fqn, m in model.named_modules() if module_filter(m, fqn)]
        for m in linears:
            swap_to_float8(m, float8_grad_weight=TRITON_RECIPES[str(recipe)], fast_accum_backward=fast_accum)
        if fold_activation:
            for m in list(model.modules()):
                if isinstance(m, SwiGLUFeedForward):
                    fold_swiglu(m)
                else:
                    fold_mlp_activation(m)
        return len(linears)
    import dataclasses

    from torchao.float8 import Float8LinearConfig, convert_to_float8_training
    from torchao.float8.config import Float8GemmConfig
    from torchao.float8.float8_linear import Float8Linear

    if recipe == "tensorwise":
        config = Float8LinearConfig(enable_fsdp_float8_all_gather=fsdp_float8_all_gather, emulate=emulate)
    else:
        # torchao gathers float8 only for tensorwise scales; rowwise weights are gathered in bf16
        # str(): torchao matches `type(name) == str`, so a StrEnum member fell through to "unknown recipe_name"
        # (the run sets Inductor's emulate_precision_casts for these recipes: src/speed/inductor.py)
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(str(recipe)), emulate=emulate)
    if fast_accum:
        config = dataclasses.replace(config, gemm_config_grad_input=Float8GemmConfig(use_fast_accum=True),
                                     gemm_config_grad_weight=Float8GemmConfig(use_fast_accum=True))
    convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    return sum(isinstance(m, Float8Linear) for m in model.modules())


def scale_precompute(model: nn.Module) -> Callable[[], None]:
    """What runs after each optimizer step when FSDP2 gathers float8 weights: the next step's
    weight scales from one all-reduce of the amaxes (torchao's precompute_float8_dynamic_scale_for_fsdp)."""
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    return lambda: precompute_float8_dynamic_scale_for_fsdp(model)
