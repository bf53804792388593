"""Export the edge model with iree.turbine.aot and compile it with IREE, weights kept apart.

One MLIR module holds the entry points (FUNCTIONS: prefill, prefill_token_into, decode, decode_token,
decode_token_into, kv_cache); the parameters are externalised, so the compiled module (.vmfb) holds code only and the
weights go out as an IREE parameter archive (.irpa) that the runtime maps at load time. A module then depends on the model's shapes, not its
values: it is cached under `edge.cache_dir` by a key over the model config, the shapes, dtype,
the weights' quantization (edge.quant: int8 or int4 globals and their scales), target device and flags, the IREE and torch versions and the exporting source; a new checkpoint needs a new archive
only (written in well under a second), not a new compile.

Artifacts (a run directory, or `edge.artifacts` with action=compile):
    module.vmfb, params.irpa (src/edge/params.py; left out with params=False, for a device that
    writes its own), manifest.json (what was compiled, for what, with which variant and flags),
    msl/*.metal for Metal when compiled off macOS (MSL source; on macOS a metallib is embedded).
"""
from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import platform
import re
import shutil
import tempfile
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from src.edge.model import EdgeLM
from src.runtime import installed_version

log = logging.getLogger("src.edge")

MANIFEST = "manifest.json"
# the module's entry points; artifacts compiled before decode_token list prefill, decode and kv_cache,
# before prefill_token_into the five others
FUNCTIONS = ("prefill", "prefill_token_into", "decode", "decode_token", "decode_token_into", "kv_cache")
SCHEMA = "perflab.edge/2"  # 2: the KV cache inside the module, greedy token out


@dataclass
class Artifacts:
    dir: Path
    manifest: dict[str, Any]
    params: Path | None = None
    """the parameter archive when it lives apart from the module (written on the device)"""

    @property
    def vmfb(self) -> Path:
        return self.dir / "module.vmfb"

    @property
    def irpa(self) -> Path:
        return self.params or self.dir / "params.irpa"


# Hoist no constant expression whose result is larger than its inputs. The decode's KV-cache write
# (`index_copy_`, src/edge/model.py) lowers to a scatter whose index tensor, (L*B*heads*head_dim, 5)
# int64 (80 KiB for model=small at batch 1), is constant but for the position column. By default
# IREE hoists it into a global, and each decode call then copies it into a fresh buffer
# (queue.alloca + queue.copy) for the dispatches to write the position in; the call's other two
# allocations wait on that copy, i.e. on the GPU, in the middle of the call, and a dealloca and a
# barrier follow: decode's queue ops are 3 alloca, 1 copy, 1 execute, 2 dealloca, 1 barrier. With
# this flag the index tensor is made by a dispatch inside the call's one command buffer: 2 alloca
# (waiting only on the previous call), 1 execute, 1 dealloca. The weight transposes IREE hoists
# grow nothing and stay hoisted.
# It is the Vulkan default (build): it made small fp16 batch-1 decode about a fifth faster and was
# faster in every row of the device calls that measured it. Where a module does not compile with it
# (IREE 3.13: tiny fp16 at batch 2 for llvmpipe, prefill's softmax), IREE's default hoisting is used
# and the manifest says so (`hoisting`).
HOIST_THRESHOLD = "--iree-opt-const-expr-max-size-increase-threshold="
NO_GROWING_HOISTS = HOIST_THRESHOLD + "0"
GROWING_HOISTS = HOIST_THRESHOLD + str(1024 * 1024)  # IREE 3.13's own default, named for comparisons
# short names in a variant's name for flags whose own would make it unreadable
FLAG_NAMES = {NO_GROWING_HOISTS: "nogrowhoist", GROWING_HOISTS: "growhoist"}


def compile_flags(device: str, target: str, features: str = "", msl_dir: Path | None = None) -> list[str]:
    """iree-compile flags for `device` (vulkan, metal or llvm-cpu)."""
    if device == "vulkan":
        flags = ["--iree-hal-target-device=vulkan", f"--iree-vulkan-target={target}"]
        return flags + ([f"--iree-vulkan-target-features={features}"] if features else [])
    if device == "metal":
        # a metallib needs Apple's `metal` compiler (Xcode); elsewhere stop at MSL source
        to_metallib = platform.system() == "Darwin" and shutil.which("xcrun") is not None
        flags = ["--iree-hal-target-device=metal", f"--iree-metal-target-platform={target}", f"--iree-metal-compile-to-metallib={str(to_metallib).lower()}"]
        return flags + ([f"--iree-hal-dump-executable-binaries-to={msl_dir}"] if msl_dir is not None and not to_metallib else [])
    if device == "llvm-cpu":
        return ["--iree-hal-target-device=local", "--iree-hal-local-target-device-backends=llvm-cpu", "--iree-llvmcpu-target-cpu=host"]
    raise ValueError(f"no IREE target device {device!r}")


def module_key(model: dict, batch: int, prompt_len: int, max_seq: int, dtype: str, device: str, flags: list[str],
               functions: tuple[str, ...] = FUNCTIONS, quant: dict | None = None, matvec_rows: int = 0) -> str:
    """`quant`: how the weights are stored (src/edge/quant.py quant_spec): the module's globals are
    int8 weights and scales instead of the dtype's, and its dispatches dequantize them.
    `matvec_rows`: products of up to that many rows exported weights first (src/edge/matvec.py)."""
    import iree.compiler
    import iree.turbine

    versions = {"iree": getattr(iree.compiler, "__version__", "") or installed_version("iree-base-compiler"),
                "turbine": installed_version("iree-turbine"), "torch": torch.__version__, "code": _code_hash()}
    blob = json.dumps({"schema": SCHEMA, "model": model, "batch": batch, "prompt_len": prompt_len, "max_seq": max_seq,
                       "dtype": dtype, "quant": quant or {"format": "none"}, "device": device, "functions": functions, "flags": [f for f in flags if "dump-executable" not in f], **versions,
                       **({"matvec_rows": matvec_rows} if matvec_rows else {})}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _code_hash() -> str:
    """The source that decides what gets exported: a change to a model (any architecture's folder)
    or to the exporter is a new module."""
    import src.edge.int4 as edge_int4
    import src.edge.matvec as edge_matvec
    import src.edge.model as edge_model
    import src.edge.quant as edge_quant

    models = Path(__file__).resolve().parents[1] / "models"
    digest = hashlib.sha256()
    for path in [Path(m.__file__) for m in (edge_model, edge_quant, edge_matvec, edge_int4)] + sorted(models.rglob("*.py")):
        digest.update(path.read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def export_module(lm: EdgeLM, prompt_len: int, mlir: Path, functions: tuple[str, ...] = FUNCTIONS) -> None:
    """`functions` of `lm` (its cache sized for the batch; FUNCTIONS by default) to one MLIR module,
    the parameters and the cache named as external parameters."""
    import iree.turbine.aot as aot

    from src.edge.int4 import bitcast_int4, unpackings
    from src.edge.quant import quant_spec

    batch = lm.batch
    aot.externalize_module_parameters(lm)
    fxb = aot.FxProgramsBuilder(lm)

    step = (torch.zeros(batch, dtype=torch.int32), torch.zeros(1, dtype=torch.int32))
    programs = {
        "prefill": ((torch.zeros(batch, prompt_len, dtype=torch.int32),), lambda module, tokens: module.prefill(tokens)),
        # the time to first token's call: the token into a caller's buffer, no logits result
        "prefill_token_into": ((torch.zeros(batch, prompt_len, dtype=torch.int32), torch.zeros(batch, dtype=torch.int32)),
                               lambda module, tokens, out: module.prefill_token_into(tokens, out)),
        "decode": (step, lambda module, token, pos: module.decode(token, pos)),
        # decode without the logits result: they stay inside the call, so the timed loop's step
        # allocates and returns one [B] int32 buffer instead of that and a [B, vocab] one
        "decode_token": (step, lambda module, token, pos: module.decode_token(token, pos)),
        # the token written into a caller's buffer: no result alloca at all (the runner's own
        # host-visible buffers, read where they are mapped)
        "decode_token_into": ((*step, torch.zeros(batch, dtype=torch.int32)),
                              lambda module, token, pos, out: module.decode_token_into(token, pos, out)),
        # a program needs an argument; clones, so no global is aliased out
        "kv_cache": ((torch.zeros(1, dtype=torch.int32),), lambda module, unused: (module.k_cache.clone(), module.v_cache.clone())),
    }
    with warnings.catch_warnings():
        # torch.export's run_decompositions deep-copies the module call graph, and copying a LeafSpec
        # calls its deprecated constructor: torch's own FutureWarning, one per program, nothing we call
        warnings.filterwarnings("ignore", message=r"`isinstance\(treespec, LeafSpec\)` is deprecated", category=FutureWarning)
        for name in functions:
            args, program = programs[name]
            fxb.export_program(name=name, args=args, strict=False)(program)

    aot.export(fxb).save_mlir(str(mlir))
    if quant_spec(lm).get("format") == "int4":
        text = mlir.read_text()
        text, rewritten = bitcast_int4(text)
        found = unpackings(text)
        if rewritten != found:
            raise RuntimeError(f"{rewritten} of the exported module's {found} int4 unpackings read as i4: "
                               "the export's form changed (src/edge/int4.py matches it)")
        mlir.write_text(text)


# OpCapability CooperativeMatrixKHR (6022) as SPIR-V words: what the driver must support to load it
_COOP_CAPABILITY = (0x00020011).to_bytes(4, "little") + (6022).to_bytes(4, "little")


def uses_cooperative_matrix(binaries: Path) -> bool:
    """Whether any SPIR-V executable IREE wrote under `binaries` declares cooperative matrices."""
    return any(_COOP_CAPABILITY in f.read_bytes() for f in binaries.rglob("*.spv"))


def build(lm: EdgeLM, model_cfg: dict, prompt_len: int, dtype: str, device: str, target: str, features: str,
          out_dir: Path, cache_dir: Path, weights: dict | None = None, extra_flags: tuple[str, ...] = (), variant: str = "",
          params: bool = True, functions: tuple[str, ...] = FUNCTIONS) -> Artifacts:
    """Compile (or take from the cache) the module for `device`/`target` and `lm`'s batch, write it
    (and with `params` the parameters of `lm`) to `out_dir`; returns the artifacts with their
    manifest, which records `weights` (where the parameters came from) so a later `action=run`
    rebuilds the reference and the archive, and `variant` with the flags that make it.
    `functions` without decode_token makes a module as compiled before it (for its fallback)."""
    import iree.compiler as ic
    from iree.compiler.tools.binaries import CompilerToolError

    from src.edge.matvec import matvec_rows
    from src.edge.params import write_params
    from src.edge.quant import quant_spec

    # iree-compile's whole command line, logged at INFO on the root logger before each compile: the
    # manifest records the flags, and a failed compile's CompilerToolError repeats the command
    logging.getLogger("iree.compiler.tools.binaries").setLevel(logging.WARNING)
    out_dir.mkdir(parents=True, exist_ok=True)
    # no growing hoists by default on Vulkan, unless the caller set the threshold (given twice, an
    # iree-compile option is an error)
    auto_hoist = device == "vulkan" and not any(f.startswith(HOIST_THRESHOLD) for f in extra_flags)
    chosen = list(extra_flags) + ([NO_GROWING_HOISTS] if auto_hoist else [])
    flags = compile_flags(device, target, features) + chosen
    quant, rows = quant_spec(lm), matvec_rows(lm)
    key = module_key(model_cfg, lm.batch, prompt_len, lm.max_seq, dtype, device, flags, functions, quant, rows)
    cached = cache_dir / key
    t0 = time.perf_counter()
    if (cached / "module.vmfb").is_file():
        hit, compile_s = True, 0.0
        made = json.loads((cached / "compile.json").read_text())
        # the key holds the exporting source's hash: a module another checkout compiled is reused only
        # where its source is this one's, and the log says whose it was
        origin = f", compiled from {made['source_root']} at {made['compiled_at']}" if made.get("source_root") else ""
        log.info("compiled module from the cache (key %s: the same model, shapes, flags, IREE, torch and source%s): %s", key, origin, cached)
    else:
        hit = False
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            mlir = Path(tmp) / "module.mlir"
            export_module(copy.deepcopy(lm), prompt_len, mlir, functions)
            export_s = time.perf_counter() - t0
            staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=_ensure(cache_dir)))
            msl = staging / "msl" if device == "metal" else None
            binaries = Path(tmp) / "binaries"
            dump = [f"--iree-hal-dump-executable-binaries-to={binaries}"] if device == "vulkan" else []
            t1 = time.perf_counter()
            hoisting = "no growing hoists" if NO_GROWING_HOISTS in chosen else "IREE's default"

            def compile_with(extra: list[str]) -> None:
                ic.compile_file(str(mlir), output_file=str(staging / "module.vmfb"), extra_args=compile_flags(device, target, features, msl) + extra + dump)

            try:
                compile_with(chosen)
            except CompilerToolError as err:
                if not auto_hoist:
                    raise
                first = compile_error_line(err)
                log.warning("does not compile without growing hoists (%s); compiling with IREE's default hoisting", first[:200])
                shutil.rmtree(binaries, ignore_errors=True)
                chosen = list(extra_flags)
                hoisting = f"IREE's default (without growing hoists: {first[:200]})"
                compile_with(chosen)
            compile_s = time.perf_counter() - t1
            coop = uses_cooperative_matrix(binaries) if device == "vulkan" else False
            steps = step_figures(staging / "module.vmfb")
            log.info("exported in %.1f s, compiled for %s in %.1f s", export_s, " ".join([device, target, *extra_flags]), compile_s)
            (staging / "compile.json").write_text(json.dumps({"compile_s": compile_s, "export_s": export_s, "flags": compile_flags(device, target, features) + chosen,
                                                              "cooperative_matrix": coop, **steps, "hoisting": hoisting,
                                                              "source_root": str(Path(__file__).resolve().parents[2]),
                                                              "compiled_at": time.strftime("%Y-%m-%d %H:%M:%S")}))
            try:
                staging.rename(cached)  # atomic: a concurrent job that got there first wins
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
    shutil.copyfile(cached / "module.vmfb", out_dir / "module.vmfb")
    if (cached / "msl").is_dir():
        shutil.copytree(cached / "msl", out_dir / "msl", dirs_exist_ok=True)
    params_bytes = write_params(lm, out_dir / "params.irpa") if params else None
    compiled = json.loads((cached / "compile.json").read_text())
    manifest = {
        "schema": SCHEMA, "key": key, "cache": "hit" if hit else "miss", "device": device, "target": target, "flags": compiled.get("flags", flags),
        "hoisting": compiled.get("hoisting"),
        "variant": variant or default_variant(target, compiled.get("cooperative_matrix", False), extra_flags, quant, rows),
        "quant": quant, "matvec_rows": rows,
        # each decode entry point's queue ops, and the bytes of each of its queue allocas (results
        # first, then transients)
        **{key: compiled.get(key) for name in STEP_FUNCTIONS for key in (f"{name}_queue_ops", f"{name}_alloca_bytes")},
        "cooperative_matrix": compiled.get("cooperative_matrix", False),
        "model": model_cfg, "weights": weights or {}, "batch": lm.batch, "prompt_len": prompt_len, "max_seq": lm.max_seq, "dtype": dtype,
        "functions": list(functions), "compile_s": compile_s, "compile_s_when_built": compiled["compile_s"],
        "module_bytes": (out_dir / "module.vmfb").stat().st_size, "params_bytes": params_bytes,
        "msl_files": sorted(p.name for p in (out_dir / "msl").glob("*.metal")) if (out_dir / "msl").is_dir() else [],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return Artifacts(out_dir, manifest)


def compile_error_line(err: BaseException) -> str:
    """The first `error:` line of an iree-compile failure (its message is the whole command and log)."""
    return next((line.strip() for line in str(err).splitlines() if "error:" in line), "iree-compile failed")


def default_variant(target: str, cooperative_matrix: bool, extra_flags: tuple[str, ...] | list[str] = (), quant: dict | None = None,
                    matvec_rows: int = 0) -> str:
    """A short name for how a module was compiled: target, coop or nocoop, then any extra flags,
    then `matvecN` where products of up to N rows are matvecs, then the weights' quantization
    (int8, int4g32) where there is one."""
    from src.edge.tiles import flag_name

    extras = [FLAG_NAMES.get(f) or flag_name(f) or f.removeprefix("--iree-").replace("=", "") for f in extra_flags
              if "dump-executable" not in f]  # what was dumped is not how it was compiled (nor in module_key)
    fmt = (quant or {}).get("format", "none")
    weights = [] if fmt == "none" else [fmt + (f"g{quant['group_size']}" if "group_size" in quant else "")]
    rows = [f"matvec{matvec_rows}"] if matvec_rows > 1 else []
    return "-".join([target, "coop" if cooperative_matrix else "nocoop", *extras, *rows, *weights])


# the entry points whose queue ops and allocation sizes the manifest records (`NAME_queue_ops`,
# `NAME_alloca_bytes`, of NAME$async)
STEP_FUNCTIONS = ("prefill", "prefill_token_into", "decode", "decode_token", "decode_token_into")


def step_figures(vmfb: Path) -> dict[str, Any]:
    """`NAME_queue_ops` and `NAME_alloca_bytes` of each of STEP_FUNCTIONS, from one disassembly of
    the module (None where the tool is missing or the function is not in the module)."""
    text = _disassembly(vmfb)
    figures: dict[str, Any] = {}
    for name in STEP_FUNCTIONS:
        body = _function_body(text, f"{name}$async") if text is not None else None
        figures[f"{name}_queue_ops"] = queue_ops(body) if body is not None else None
        figures[f"{name}_alloca_bytes"] = alloca_bytes(body) if body is not None else None
    return figures


def queue_ops(text: str) -> dict[str, int]:
    """How many of each `hal.device.queue.*` call a function makes, from its body in
    `iree-dump-module`'s disassembly (iree-base-runtime), e.g. {"alloca": 2, "dealloca": 1,
    "execute.indirect": 1} for decode compiled with NO_GROWING_HOISTS. IREE 3.13's Vulkan HAL does
    each alloca, dealloca and barrier on the host, once its wait fences are reached: one that waits
    on work of the same call waits for the GPU."""
    counts: dict[str, int] = {}
    for op in re.findall(r"@hal\.device\.queue\.([a-z_.]+)[( ]", text):
        counts[op] = counts.get(op, 0) + 1
    return dict(sorted(counts.items()))


def alloca_bytes(text: str) -> list[int | None]:
    """The byte size of each `hal.device.queue.alloca` of a function's disassembled body, in order
    (None for a size not a constant): the op counts of decode and decode_token are the same, what
    differs is the size of the results' allocation (tiny, batch 2: 2112 bytes with the logits, 8
    without)."""
    constants: dict[str, int] = {}
    sizes: list[int | None] = []
    for line in text.splitlines():  # the entry block is straight-line: a register's last constant is its value
        const = re.match(r"\s*%(i\d+)(?::\d+)? = vm\.const\.i64(?:\.zero| (-?\d+))", line)
        if const:
            constants[const.group(1)] = int(const.group(2) or 0)
            continue
        call = re.search(r"@hal\.device\.queue\.alloca\(([^)]*)\)", line)
        if call:  # (device, affinity, wait, signal, pool, memory type, usage, size, flags)
            size = call.group(1).split(",")[7].strip().lstrip("%").lower()  # %I: the register's last use
            sizes.append(constants.get(size))
    return sizes


def _disassembly(vmfb: Path) -> str | None:
    """`iree-dump-module`'s disassembly of the module; None where the tool is missing or fails."""
    import subprocess

    exe = shutil.which("iree-dump-module") or _runtime_tool("iree-dump-module")
    if exe is None:
        return None
    try:
        text = subprocess.run([exe, "--output=disassembly", str(vmfb)], capture_output=True, text=True, timeout=120).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    return text


def _function_body(text: str, function: str) -> str | None:
    """`function`'s body in a module's disassembly; None where it is not there."""
    start = text.find(f"vm.func @{function}(")
    if start < 0:
        return None
    end = text.find("\n}", start)
    return text[start:end if end > 0 else None]


def _runtime_tool(name: str) -> str | None:
    try:
        import iree._runtime_libs as libs
    except ImportError:
        return None
    path = Path(libs.__file__).parent / name
    return str(path) if path.is_file() else None


def _ensure(path: Path) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    return path


def load_artifacts(path: Path) -> Artifacts:
    manifest_path = path / MANIFEST
    if not manifest_path.is_file():
        raise FileNotFoundError(f"{path}: no {MANIFEST}; make the artifacts with edge.action=compile")
    manifest = json.loads(manifest_path.read_text())
    if manifest.get("schema") != SCHEMA:
        raise ValueError(f"{manifest_path}: schema {manifest.get('schema')!r}, this version reads {SCHEMA}")
    return Artifacts(path, manifest)


def cache_root(setting: str) -> Path:
    return Path(os.path.expanduser(os.path.expandvars(setting)))
