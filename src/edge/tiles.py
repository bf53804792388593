"""Workgroup tiles of the prefill's matmuls, set through an IREE transform library (a compile flag).

IREE 3.13's SPIR-V heuristics tile a prefill's products for a GPU that runs one matmul at a time:
`model=small` at a 128-token prompt, fp16 for `pascal` (MatmulPromoteVectorize, workgroups of
32 x 8 threads, 64 x 256 outputs each), gets 16 workgroups for the MLP's up projection, 12 for
q/k/v, 4 each for the output and down projections (the down one 64 serial steps of K deep), and
8 for each of attention's two products (128 x 128 tiles over 8 heads): a fraction of a large GPU's
SMs, in a step whose products run one after another. `prefill_tiles_flag` makes a library that
matches every f16 or f32 contraction with `rows` rows (the prompt's tokens times the batch: the
projections'; attention's too at batch 1, whose rows are one sequence's) and gives it `tile`
outputs a workgroup with a 4 x 4 thread tile; at 16 x 64, those become 192, 64, 256, 64
workgroups, and attention's 128 and 64 (tests/system/test_edge_configs.py reads them back).

How: `--iree-codegen-transform-dialect-library=FILE` (its `__kernel_config` sequence runs on each
executable before IREE's own configuration, and what it annotates keeps its `compilation_info`).
IREE's `--iree-codegen-tuning-spec-path` is not read for SPIR-V in 3.13 (a file of garbage
compiles without a word), the library is (the same garbage fails the compile). On lavapipe the
tiled module gives torch's tokens (tiny, fp32 and fp16: tests/system/test_edge_tiles.py).
"""
from __future__ import annotations

import hashlib
from pathlib import Path

from src.edge.matvec import MAX_MATVEC_ROWS

LIBRARY_FLAG = "--iree-codegen-transform-dialect-library="
# The tile a run's prefill gets where one was measured: `pascal` (NVIDIA without cooperative
# matrices) in fp16, model=small's prompt: this tile cut the time to first token to about a sixth of
# IREE's own tiles' (a taller one was level with it), near torch CUDA eager's (benchmarks/edge_vs_torch.py).
MEASURED_TILES = {("pascal", "fp16"): (16, 64)}
THREAD_TILE = 4  # outputs a thread computes along M and along N: 4 x 4 (IREE's own tile for pascal: 8 x 8)
K_TILE = 32  # IREE's own for these products


def library(rows: int, tile: tuple[int, int], dtype: str, batches: tuple[int, ...]) -> str:
    """The transform library: contractions of `rows` rows in `dtype` (fp16: f16 operands, f32
    accumulation, as IREE forms them; fp32: f32 throughout), of no batch dimension or of one of
    `batches` (the projections' batch of 1, attention's sequences x heads), tiled `tile` (M, N)."""
    tm, tn = tile
    if tm % THREAD_TILE or tn % THREAD_TILE:
        raise ValueError(f"prefill tile {tm}x{tn}: both sides a multiple of {THREAD_TILE}")
    operand, acc = {"fp16": ("f16", "f32"), "fp32": ("f32", "f32")}[dtype]
    workgroup = (tn // THREAD_TILE, tm // THREAD_TILE)
    if workgroup[0] * workgroup[1] > 1024:
        raise ValueError(f"prefill tile {tm}x{tn}: {workgroup[0] * workgroup[1]} threads a workgroup, more than 1024")
    sequences, names = [], []
    for batch in (None, *sorted(set(batches))):
        name = f"match_rows{rows}_" + ("nobatch" if batch is None else f"batch{batch}")
        names.append(name)
        dims, lead = ("[]", "") if batch is None else (f"[{batch}]", "1, ")
        sequences.append(f"""
  transform.named_sequence @{name}(%op: !transform.any_op {{transform.readonly}}) -> (!transform.any_op, !transform.any_param) {{
    %batch, %m, %n, %k = transform.iree.match.contraction %op, lhs_type = {operand}, rhs_type = {operand}, output_type = {acc} : !transform.any_op -> !transform.param<i64>
    transform.iree.match.dims_equal %batch, {dims} : !transform.param<i64>
    transform.iree.match.dims_equal %m, [{rows}] : !transform.param<i64>
    %config = transform.param.constant #iree_codegen.compilation_info<
      lowering_config = #iree_codegen.lowering_config<tile_sizes = [[{lead}{tm}, {tn}, {K_TILE}]]>,
      translation_info = #iree_codegen.translation_info<pipeline = #iree_gpu.spirv_pipeline<MatmulPromoteVectorize> workgroup_size = [{workgroup[0]}, {workgroup[1]}, 1], {{pipeline_depth = 1 : i64, store_stage = 1 : i64}}>> -> !transform.any_param
    transform.yield %op, %config : !transform.any_op, !transform.any_param
  }}""")
    matches = ", ".join(f"@{name} -> @apply_op_config" for name in names)
    return f"""module attributes {{transform.with_named_sequence}} {{
  transform.named_sequence @apply_op_config(%op: !transform.any_op {{transform.readonly}}, %config: !transform.any_param {{transform.readonly}}) {{
    transform.annotate %op "compilation_info" = %config : !transform.any_op, !transform.any_param
    transform.yield
  }}{"".join(sequences)}
  transform.named_sequence @__kernel_config(%variant: !transform.any_op {{transform.consumed}}) -> !transform.any_op {{
    %res = transform.foreach_match in %variant {matches} : (!transform.any_op) -> !transform.any_op
    transform.yield %res : !transform.any_op
  }}
}}
"""


def prefill_tiles_flag(directory: Path, rows: int, tile: tuple[int, int], dtype: str, batches: tuple[int, ...]) -> str:
    """The iree-compile flag for `library(...)`, written under `directory` by its content (the same
    library, the same path: the flag, so the module's cache key, stays put)."""
    text = library(rows, tile, dtype, batches)
    path = Path(directory).expanduser() / f"prefill-tiles{tile[0]}x{tile[1]}-{hashlib.sha256(text.encode()).hexdigest()[:12]}.mlir"
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.is_file():
        path.write_text(text)
    return LIBRARY_FLAG + str(path)


def flag_name(flag: str) -> str | None:
    """`tiles16x64` for a prefill-tiles library flag (a variant's name), else None."""
    if not flag.startswith(LIBRARY_FLAG):
        return None
    stem = Path(flag[len(LIBRARY_FLAG):]).stem
    return stem.split("-")[1] if stem.startswith("prefill-tiles") else "tdlibrary"


def default_prefill_flags(directory: Path, target: str, dtype: str, rows: int, n_heads: int, batch: int) -> tuple[str, ...]:
    """The flags a module for `target` in `dtype` gets for its prefill of `rows` rows (batch x prompt)
    by default: MEASURED_TILES' library where there is one, nothing elsewhere (IREE's own tiles).
    Prefills of up to MAX_MATVEC_ROWS rows are matvecs (src/edge/matvec.py), left to IREE."""
    tile = MEASURED_TILES.get((target, dtype))
    if tile is None or rows <= MAX_MATVEC_ROWS:
        return ()
    return (prefill_tiles_flag(directory, rows, tile, dtype, (1, batch * n_heads)),)
