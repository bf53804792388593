"""int4 weights as IREE's own i4 type in the exported module, so their dequantization fuses into the
matvec that reads them (`edge.quant=int4`, src/edge/quant.py).

torch has no int4 tensors that iree.turbine can export, so QuantLinear keeps two nibbles a byte in
an int8 weight and unpacks them with shifts. IREE 3.13 clones a producer into a matmul's dispatch
only if it is a dequantization-like elementwise op (extension, mul, add, sub); the shifts are not,
and the unpacked weight also has twice its input's elements, so each call unpacked into a transient,
dequantized into another, then multiplied: three dispatches a Linear. Here the exported MLIR's
unpacking, `view(shift(shift(unsqueeze(w))))` of an `(out, in / 2)` int8 global, is replaced by

    flow.tensor.bitcast  tensor<out x in/2 x i8>  ->  tensor<out x in x i4>
    tensor.expand_shape  -> (out, in / group, group)
    linalg.generic       arith.extsi i4 -> i8

the bytes as they are (IREE packs i4 low nibble first, which is QuantLinear's order: column 2j in
the low nibble, 2j + 1 in the high one; extsi sign-extends the two's-complement nibble as the
arithmetic shifts did). The rest (to the dtype, times the group's scale) is elementwise on it, and
QuantLinear's grouped product (`grouped_product`) contracts over groups and their members, the form
IREE clones the dequantization into: for `pascal`, one row is one `matvec_like` dispatch reading
the i4 weight (SubgroupReduce), and 4 rows weights first another (tests/system/test_edge_configs.py).

Verified with IREE 3.13 (iree-base-compiler) and iree-turbine 3.9 exporting from torch 2.13 (the tests' torch);
build() refuses a module whose unpackings it did not all find.
"""
from __future__ import annotations

import re

_NAME = r"%[\w.$-]+"
# the unpacked weight, reshaped into its groups: what QuantLinear.dequantized's view makes
_VIEW = re.compile(rf"^(\s*)({_NAME}) = torch\.aten\.view ({_NAME}), {_NAME} : !torch\.vtensor<\[(\d+),(\d+),2\],si8>, "
                   rf"!torch\.list<int> -> !torch\.vtensor<\[(\d+),(\d+),(\d+)\],si8>")
_RIGHT = re.compile(rf"= torch\.aten\.bitwise_right_shift\.Tensor ({_NAME}), ")
_LEFT = re.compile(rf"= torch\.aten\.bitwise_left_shift\.Tensor ({_NAME}), ")
_UNSQUEEZE = re.compile(rf"= torch\.aten\.unsqueeze ({_NAME}), ")
_FROM_GLOBAL = re.compile(rf"= torch_c\.from_builtin_tensor ({_NAME}) : tensor<(\d+)x(\d+)xi8> -> ")


def _definition(lines: list[str], before: int, name: str) -> str:
    """The line that defines SSA value `name`, searched upward from line `before` (values are
    defined above their uses, and a function's names are its own: the nearest is its one)."""
    head = f"{name} = "
    for i in range(before - 1, -1, -1):
        if lines[i].lstrip().startswith(head):
            return lines[i]
    return ""


def _i4_unpack(indent: str, result: str, weight: str, out: int, half: int, groups: int, group: int) -> str:
    tag = "%i4_" + re.sub(r"[^\w]", "_", result.lstrip("%"))
    packed, grouped, empty, wide = f"{tag}_i4", f"{tag}_groups", f"{tag}_empty", f"{tag}_i8"
    inner, nibble, byte = f"{tag}_in", f"{tag}_out", f"{tag}_ext"
    maps = "affine_map<(d0, d1, d2) -> (d0, d1, d2)>"
    return "\n".join([
        f"{indent}{packed} = flow.tensor.bitcast {weight} : tensor<{out}x{half}xi8> -> tensor<{out}x{2 * half}xi4>",
        f"{indent}{grouped} = tensor.expand_shape {packed} [[0], [1, 2]] output_shape [{out}, {groups}, {group}] "
        f": tensor<{out}x{2 * half}xi4> into tensor<{out}x{groups}x{group}xi4>",
        f"{indent}{empty} = tensor.empty() : tensor<{out}x{groups}x{group}xi8>",
        f'{indent}{wide} = linalg.generic {{indexing_maps = [{maps}, {maps}], iterator_types = ["parallel", "parallel", "parallel"]}} '
        f"ins({grouped} : tensor<{out}x{groups}x{group}xi4>) outs({empty} : tensor<{out}x{groups}x{group}xi8>) {{",
        f"{indent}^bb0({inner}: i4, {nibble}: i8):",
        f"{indent}  {byte} = arith.extsi {inner} : i4 to i8",
        f"{indent}  linalg.yield {byte} : i8",
        f"{indent}}} -> tensor<{out}x{groups}x{group}xi8>",
        f"{indent}{result} = torch_c.from_builtin_tensor {wide} : tensor<{out}x{groups}x{group}xi8> -> !torch.vtensor<[{out},{groups},{group}],si8>",
    ])


def bitcast_int4(text: str) -> tuple[str, int]:
    """`text` (an exported module's MLIR) with every int4 weight's nibble unpacking read through an
    i4 bitcast of its global instead; and how many were. The shifts are left unused (IREE drops them)."""
    lines = text.split("\n")
    out = list(lines)
    rewritten = 0
    for i, line in enumerate(lines):
        view = _VIEW.match(line)
        if view is None:
            continue
        indent, result, unpacked, rows, half, rows_again, groups, group = view.groups()
        name = unpacked  # right shift <- left shift <- unsqueeze <- the int8 global
        for pattern in (_RIGHT, _LEFT, _UNSQUEEZE):
            found = pattern.search(_definition(lines, i, name))
            if found is None:
                break
            name = found.group(1)
        else:
            found = _FROM_GLOBAL.search(_definition(lines, i, name))
            if found is None or (found.group(2), found.group(3)) != (rows, half) or rows != rows_again:
                continue
            out[i] = _i4_unpack(indent, result, found.group(1), int(rows), int(half), int(groups), int(group))
            rewritten += 1
    return "\n".join(out), rewritten


def unpackings(text: str) -> int:
    """The nibble unpackings in `text` (one right shift each): what bitcast_int4 should find."""
    return sum(1 for line in text.split("\n") if "torch.aten.bitwise_right_shift.Tensor" in line)
