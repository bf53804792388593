"""Weight-only quantization of the edge model (`edge.quant`): the blocks' Linear weights stored as
integers with their scales, dequantized inside the module right before each matmul.

- int8: per output channel, symmetric: scale = max |w[o, :]| / 127, q = round(w / scale) in
  [-127, 127] (no -128: the range stays symmetric around 0). One scale per row.
- int4: group-wise, symmetric: each run of `group_size` weights along the input dim shares a
  scale = max |w| / 7, q in [-7, 7]. Two values a byte, two's-complement nibbles in an int8:
  column 2j in the low nibble, 2j + 1 in the high one. Unpacked in torch with shifts alone
  (`(p << 4) >> 4` and `p >> 4`, arithmetic shifts sign-extend), written as one broadcast over a
  [4, 0] shift pair. torch has `torch.int4` only as a dtype name (no kernels, and iree.turbine maps
  no i4 tensor type: iree/turbine/support/conversions.py), so the exported module's unpacking is
  rewritten into IREE's own i4 type, a bitcast of the int8 global (src/edge/int4.py); a turbine
  custom op could emit it, but turbine 3.9's custom-op expansion fails with this IREE's MLIR
  bindings (`IntegerType.isinstance`).

What IREE 3.13 makes of it for Vulkan (from the dispatch sources `iree-compile --iree-hal-dump-executable-sources-to=DIR` writes):
- int8 written as `F.linear(x, q * scale)`: IREE fuses the dequantization into the matmul's dispatch
  (it binds the int8 weight and the scales and converts in registers:
  `decode$async_dispatch_4_batch_matmul_1x1x192x64_f32` holds sitofp, mulf, then the contraction),
  for one row and for several. But for llvmpipe a matmul with a fused int8 operand leaves the
  matmul pipeline for SPIR-V's BaseVectorize: 85-300 KB of SPIR-V a dispatch, 150 s to more than
  300 s to compile each (tiny's module: 567 s against 4-23 s unquantized, and 35 minutes for
  lavapipe to build its pipelines at the first call); so does a one-row product with 2048 inputs
  (fuse_dequantization). valhall takes more than 200 s for a fused 2 x 2048 -> 512 matmul too;
  ampere, valhall and rdna3 compile the fused matvec in 0.3-0.4 s.
- So several rows (prefill, decode at batch > 1) always, and one row on llvmpipe, go through a
  (1, rows, in) batch matmul whose weight comes from an (out, in / 2, 2) view of the integers: the
  reshape back keeps the dequantization in a dispatch of its own (it reads the int8 weight and
  writes the dtype's, transposed, a transient) and the matmul is the unquantized one (a one-Linear
  module compiles in 0.5-1.2 s, fp32 or fp16, batch 1 or 2). One row elsewhere: fused (`fuse`).
- int4: exported, one row and (edge.matvec_rows) 2-8 rows are a contraction over the groups and
  their members (`grouped_product`), into which IREE clones the i4 weight's dequantization: for
  `pascal`, each of tiny's decode products one dispatch reading i4, SubgroupReduce, at batch 1 and
  at batch 4 with matvec_rows=4 (tests/system/test_edge_configs.py); F.linear on the shifted and reshaped
  weight would be three dispatches a product (unpack into an int8 transient, dequantize, multiply). More
  rows (prefill) and llvmpipe (`fuse` off) dequantize from i4 in a dispatch of their own, then
  multiply.
- fp16 on llvmpipe compiles only with IREE's default hoisting (src/edge/compile.py), which hoists
  each dequantization into the initializer: the weights are expanded once at load and the calls
  read fp16 (the summary's `dequantization: at load`); the archive is still the smaller one.
So what shrinks everywhere is the archive and what a device has to hold before load; the resident
weights and a call's traffic shrink only where the dequantization stays in the calls.

The scales are kept in the compute dtype (fp32 or fp16), the integers as int8 parameters of the
archive (src/edge/params.py). The embedding and the head stay in the compute dtype: the embedding
is a gather, no matmul to fuse a dequantization into, and a row read per token; the head's logits
are what the greedy token and the error figures are taken from (LLaMA's head is the embedding,
tied), so quantizing it would put its error straight into every token (llama.cpp and GPTQ keep it
wider too).
"""
from __future__ import annotations

import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from src.edge.matvec import few_rows, weights_first

FORMATS = ("none", "int8", "int4")
# 32: tiny's dim (64) is the smallest in-features of a Linear here and 128 does not divide it; 32 is
# what llama.cpp's Q4_0 takes; smaller groups cost more scale bits a weight and buy accuracy: the
# logits' largest relative error was lower at 32 than at 64 on every model and seed tried
# (`python -m benchmarks.edge_quant_error --groups 32,64 --seeds 0,1,2`).
DEFAULT_GROUP = 32
INT8_MAX, INT4_MAX = 127, 7


class QuantLinear(nn.Module):
    """nn.Linear with its weight stored as int8 (`weight_q`) and scales (`weight_scale`): (out, 1)
    for int8, (out, in / group_size, 1) for int4 (whose `weight_q` is (out, in / 2), two a byte)."""

    def __init__(self, linear: nn.Linear, fmt: str, group_size: int = DEFAULT_GROUP, fuse: bool = True):
        super().__init__()
        self.fuse = fuse
        """one row (a matrix-vector product): dequantize right in the matmul's operand, which IREE
        fuses into the matvec dispatch (fuse_dequantization says for which targets)"""
        if fmt not in ("int8", "int4"):
            raise ValueError(f"quant format {fmt!r}: int8 or int4")
        w = linear.weight.detach().float()
        out, k = w.shape
        self.fmt, self.in_features, self.out_features = fmt, k, out
        self.group_size = group_size if fmt == "int4" else k
        if fmt == "int8":
            scale = w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30) / INT8_MAX
            q = torch.round(w / scale).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
        else:
            if k % group_size or group_size % 2:
                raise ValueError(f"int4 groups of {group_size} do not divide in_features={k}")
            groups = w.view(out, k // group_size, group_size)
            scale = groups.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30) / INT4_MAX
            q = torch.round(groups / scale).clamp(-INT4_MAX, INT4_MAX).to(torch.int8).view(out, k)
            q = (q[:, 0::2] & 0xF) | (q[:, 1::2] << 4)  # int8 wraps: the high nibble's sign is the byte's
        self.register_buffer("weight_q", q.contiguous())
        self.register_buffer("weight_scale", scale.to(linear.weight.dtype).contiguous())
        self.bias = None if linear.bias is None else nn.Parameter(linear.bias.detach().clone(), requires_grad=False)

    def dequantized(self, dtype: torch.dtype, apart: bool = False) -> torch.Tensor:
        """The (out, in) weight in `dtype`, what the matmul reads. `apart`: through a (out, in / 2, 2)
        view of the integers, whose reshape back keeps IREE from fusing the dequantization into the
        matmul (see the module docstring: more than one row)."""
        q = self.weight_q
        if apart and self.fmt == "int8":
            w = q.view(self.out_features, self.in_features // 2, 2).to(dtype) * self.weight_scale.to(dtype).unsqueeze(-1)
            return w.reshape(self.out_features, self.in_features)
        if self.fmt == "int4":
            shifts = torch.tensor([4, 0], dtype=torch.int8, device=q.device)
            four = torch.tensor(4, dtype=torch.int8, device=q.device)
            # torch.bitwise_*_shift with tensor shifts: torch-mlir lowers neither the `<<` / `>>`
            # operators' ops nor a shift by a Python int (bitwise_right_shift.Tensor_Scalar)
            q = torch.bitwise_right_shift(torch.bitwise_left_shift(q.unsqueeze(-1), shifts), four).reshape(self.out_features, self.in_features // self.group_size, self.group_size)
        w = q.to(dtype) * self.weight_scale.to(dtype)
        return w.reshape(self.out_features, self.in_features)

    matvec_rows: int = 0
    """products of 2 to this many rows computed weights first (src/edge/matvec.py use_matvec)"""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        rows = x.numel() // x.shape[-1]
        if self.fmt == "int4" and self.fuse and (rows == 1 or few_rows(x, self.matvec_rows)) and torch.compiler.is_exporting():
            # the exported module's form, into which IREE fuses the i4 dequantization (src/edge/int4.py);
            # torch itself multiplies the dequantized weight as below (grouped_product would hold rows x out x in floats)
            y = grouped_product(x, self.dequantized(x.dtype).view(self.out_features, -1, self.group_size))
            return y if bias is None else y + bias
        if self.fuse and rows == 1:  # one row: a matrix-vector product, the dequantization fused into it
            return F.linear(x, self.dequantized(x.dtype), bias)
        if few_rows(x, self.matvec_rows):  # a matvec of several rows: fused as one row's, where `fuse`
            return weights_first(x, self.dequantized(x.dtype, apart=not self.fuse), bias)
        rows = x.reshape(1, -1, self.in_features)  # (1, rows, in): a batch matmul, whose weight operand keeps the reshape
        y = torch.matmul(rows, self.dequantized(x.dtype, apart=True).t())
        return (y if bias is None else y + bias).reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"{self.in_features}, {self.out_features}, {self.fmt}" + (f", group {self.group_size}" if self.fmt == "int4" else "")


def grouped_product(x: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """F.linear(x, w) for w in its int4 groups, `groups` (out, in / group, group): the products summed
    over the groups and their members at once, in fp32 (what a matmul of x's dtype accumulates in).
    Exported, this is one contraction over two dims that IREE 3.13 compiles, with the i4 weight's
    dequantization inside, as a matvec (`pascal`: SubgroupReduce) for one row, and for 2-8 rows
    written weights first (src/edge/matvec.py), `(W . x)^T`."""
    out, n_groups, group = groups.shape
    rows = x.reshape(-1, n_groups, group).float()
    w = groups.float()
    if rows.shape[0] == 1:
        y = (rows.unsqueeze(1) * w.unsqueeze(0)).sum((-2, -1))
    else:
        y = (w.unsqueeze(1) * rows.unsqueeze(0)).sum((-2, -1)).t()
    return y.to(x.dtype).reshape(*x.shape[:-1], out)


def block_linears(lm: nn.Module) -> list[tuple[nn.Module, str, nn.Linear]]:
    """(parent, attribute, Linear) of every nn.Linear inside the blocks (`layers`) of an EdgeLM's
    model, or of a model of src/models/ itself."""
    found = []
    for block in getattr(lm, "model", lm).layers:
        for parent in block.modules():
            for name, child in parent.named_children():
                if type(child) is nn.Linear:
                    found.append((parent, name, child))
    return found


def group_error(lm: nn.Module, fmt: str, group_size: int) -> str | None:
    """Why `fmt` with `group_size` cannot quantize `lm`'s block Linears, or None."""
    if fmt != "int4":
        return None
    if group_size < 2 or group_size % 2:
        return f"edge.quant_group={group_size}: an even number of weights (two a byte)"
    odd = sorted({lin.in_features for _, _, lin in block_linears(lm) if lin.in_features % group_size})
    if odd:
        fits = math.gcd(group_size, *odd)
        return (f"edge.quant_group={group_size} does not divide the in-features {odd} of the model's Linears; "
                f"edge.quant_group={fits} does" if fits >= 2 and fits % 2 == 0 else "no even group size divides them: use edge.quant=int8")
    return None


def fuse_dequantization(device: str, target: str) -> bool:
    """Whether a module for `device`/`target` dequantizes a one-row (matrix-vector) product's int8
    weight inside its dispatch. Not for llvmpipe: IREE 3.13 gives a fused matvec with 2048 inputs
    (model=small's down projection) SPIR-V's BaseVectorize pipeline instead of SubgroupReduce, and
    iree-compile had not finished it after 200 s (one Linear; the unfused module: under a second);
    ampere, valhall and rdna3 compile the same fused matvec in 0.3-0.4 s."""
    return not (device == "vulkan" and target == "llvmpipe")


def quantize(lm: nn.Module, fmt: str, group_size: int = DEFAULT_GROUP, fuse: bool = True) -> nn.Module:
    """`lm` with each block Linear replaced by a QuantLinear of `fmt` (in place; "none": unchanged).
    Quantize the fp32 model, then cast it: the scales are taken from the fp32 weights and only
    the floating-point tensors change dtype (int8 stays int8)."""
    if fmt == "none":
        return lm
    why = group_error(lm, fmt, group_size)
    if why:
        raise ValueError(why)
    for parent, name, linear in block_linears(lm):
        setattr(parent, name, QuantLinear(linear, fmt, group_size, fuse))
    return lm


def quantized_copy(lm: nn.Module, spec: dict) -> nn.Module:
    """A copy of `lm` (fp32) quantized as `spec` says ({"format": ..., "group_size": ...}: a
    manifest's or quant_spec's), or `lm` itself for "none"."""
    if spec.get("format", "none") == "none":
        return lm
    return quantize(copy.deepcopy(lm), spec["format"], spec.get("group_size", DEFAULT_GROUP), spec.get("fused", True))


def quant_spec(lm: nn.Module) -> dict:
    """What `lm`'s weights are stored as: {"format": "none"}, or {"format", "fused"} and "group_size"
    for int4 ("fused": whether a one-row product dequantizes in its matvec's operand)."""
    layers = [m for m in lm.modules() if isinstance(m, QuantLinear)]
    if not layers:
        return {"format": "none"}
    spec = {"format": layers[0].fmt, "fused": layers[0].fuse}
    return {**spec, "group_size": layers[0].group_size} if layers[0].fmt == "int4" else spec


def weight_bytes(lm: nn.Module) -> dict[str, int]:
    """Bytes of the block Linears' weights as stored (integers and scales for QuantLinear), and of
    the rest of the parameters (embedding, head, norms, biases): what the format shrinks, apart."""
    quantized = rest = 0
    in_blocks = {id(m) for block in getattr(lm, "model", lm).layers for m in block.modules() if isinstance(m, (QuantLinear, nn.Linear))}
    counted: set[int] = set()
    for module in lm.modules():
        for name, tensor in list(module.named_parameters(recurse=False)) + list(module.named_buffers(recurse=False)):
            if id(tensor) in counted or name in ("k_cache", "v_cache"):
                continue
            counted.add(id(tensor))
            nbytes = tensor.numel() * tensor.element_size()
            if id(module) in in_blocks and name in ("weight", "weight_q", "weight_scale"):
                quantized += nbytes
            else:
                rest += nbytes
    return {"block_weight_bytes": quantized, "other_param_bytes": rest}
