"""Export the edge model with iree.turbine.aot and compile it with IREE, weights kept apart.

One MLIR module holds both entry points (prefill, decode); the parameters are externalised, so the
compiled module (.vmfb) holds code only and the weights go out as an IREE parameter archive
(.irpa) that the runtime maps at load time. A module then depends on the model's shapes, not its
values: it is cached under `edge.cache_dir` by a key over the model config, the shapes, dtype,
target device and flags, the IREE and torch versions and the exporting source; a new checkpoint needs a new archive
only (written in well under a second), not a new compile.

Artifacts (a run directory, or `edge.artifacts` with action=compile):
    module.vmfb, params.irpa, manifest.json (what was compiled, for what, how long it took),
    msl/*.metal for Metal when compiled off macOS (MSL source; on macOS a metallib is embedded).
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from src.edge.model import EdgeLM

log = logging.getLogger("src.edge")

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
MANIFEST = "manifest.json"
SCHEMA = "perflab.edge/1"


@dataclass
class Artifacts:
    dir: Path
    manifest: dict[str, Any]

    @property
    def vmfb(self) -> Path:
        return self.dir / "module.vmfb"

    @property
    def irpa(self) -> Path:
        return self.dir / "params.irpa"


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


def module_key(model: dict, batch: int, prompt_len: int, max_seq: int, dtype: str, device: str, flags: list[str]) -> str:
    import iree.compiler
    import iree.turbine

    versions = {"iree": getattr(iree.compiler, "__version__", "") or _dist_version("iree-base-compiler"),
                "turbine": _dist_version("iree-turbine"), "torch": torch.__version__, "code": _code_hash()}
    blob = json.dumps({"schema": SCHEMA, "model": model, "batch": batch, "prompt_len": prompt_len, "max_seq": max_seq,
                       "dtype": dtype, "device": device, "flags": [f for f in flags if "dump-executable" not in f], **versions}, sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:20]


def _code_hash() -> str:
    """The source that decides what gets exported: a change to the model or the exporter is a new module."""
    import src.edge.model as edge_model
    import src.models.mini_llm as mini_llm

    digest = hashlib.sha256()
    for module in (edge_model, mini_llm):
        digest.update(Path(module.__file__).read_bytes())
    digest.update(Path(__file__).read_bytes())
    return digest.hexdigest()[:16]


def _dist_version(name: str) -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(name)
    except PackageNotFoundError:
        return ""


def export_module(lm: EdgeLM, batch: int, prompt_len: int, dtype: torch.dtype, mlir: Path, irpa: Path) -> None:
    """prefill and decode of `lm` to one MLIR module; its parameters to an IRPA archive."""
    import iree.turbine.aot as aot

    tokens = torch.zeros(batch, prompt_len, dtype=torch.int32)
    # two distinct tensors: one passed twice would be exported as one input, aliasing values to keys
    k_cache, v_cache = lm.empty_cache(batch, dtype), lm.empty_cache(batch, dtype)
    aot.externalize_module_parameters(lm)
    fxb = aot.FxProgramsBuilder(lm)

    @fxb.export_program(name="prefill", args=(tokens,), strict=False)
    def _prefill(module, tokens):
        return module.prefill(tokens)

    @fxb.export_program(name="decode", args=(torch.zeros(batch, 1, dtype=torch.int32), torch.zeros(1, dtype=torch.int32), k_cache, v_cache), strict=False)
    def _decode(module, token, pos, k_cache, v_cache):
        return module.decode(token, pos, k_cache, v_cache)

    aot.export(fxb).save_mlir(str(mlir))
    aot.save_module_parameters(str(irpa), lm)


def save_params(lm: EdgeLM, irpa: Path) -> None:
    import iree.turbine.aot as aot

    aot.externalize_module_parameters(lm)
    aot.save_module_parameters(str(irpa), lm)


def build(lm: EdgeLM, model_cfg: dict, batch: int, prompt_len: int, dtype: str, device: str, target: str, features: str,
          out_dir: Path, cache_dir: Path, weights: dict | None = None) -> Artifacts:
    """Compile (or take from the cache) the module for `device`/`target`, write it and the
    parameters of `lm` to `out_dir`; returns the artifacts with their manifest, which records
    `weights` (where the parameters came from) so a later `action=run` rebuilds the reference."""
    import iree.compiler as ic

    out_dir.mkdir(parents=True, exist_ok=True)
    flags = compile_flags(device, target, features)
    key = module_key(model_cfg, batch, prompt_len, lm.max_seq, dtype, device, flags)
    cached = cache_dir / key
    t0 = time.perf_counter()
    if (cached / "module.vmfb").is_file():
        hit, compile_s = True, 0.0
        save_params(lm, out_dir / "params.irpa")
        log.info("compiled module from the cache: %s", cached)
    else:
        hit = False
        with tempfile.TemporaryDirectory(dir=out_dir) as tmp:
            mlir = Path(tmp) / "module.mlir"
            export_module(lm, batch, prompt_len, TORCH_DTYPES[dtype], mlir, out_dir / "params.irpa")
            export_s = time.perf_counter() - t0
            staging = Path(tempfile.mkdtemp(prefix=f"{key}.", dir=_ensure(cache_dir)))
            msl = staging / "msl" if device == "metal" else None
            t1 = time.perf_counter()
            ic.compile_file(str(mlir), output_file=str(staging / "module.vmfb"), extra_args=compile_flags(device, target, features, msl))
            compile_s = time.perf_counter() - t1
            log.info("exported in %.1f s, compiled for %s %s in %.1f s", export_s, device, target, compile_s)
            (staging / "compile.json").write_text(json.dumps({"compile_s": compile_s, "export_s": export_s, "flags": flags}))
            try:
                staging.rename(cached)  # atomic: a concurrent job that got there first wins
            except OSError:
                shutil.rmtree(staging, ignore_errors=True)
    shutil.copyfile(cached / "module.vmfb", out_dir / "module.vmfb")
    if (cached / "msl").is_dir():
        shutil.copytree(cached / "msl", out_dir / "msl", dirs_exist_ok=True)
    compiled = json.loads((cached / "compile.json").read_text())
    manifest = {
        "schema": SCHEMA, "key": key, "cache": "hit" if hit else "miss", "device": device, "target": target, "flags": flags,
        "model": model_cfg, "weights": weights or {}, "batch": batch, "prompt_len": prompt_len, "max_seq": lm.max_seq, "dtype": dtype,
        "functions": ["prefill", "decode"], "compile_s": compile_s, "compile_s_when_built": compiled["compile_s"],
        "module_bytes": (out_dir / "module.vmfb").stat().st_size, "params_bytes": (out_dir / "params.irpa").stat().st_size,
        "msl_files": sorted(p.name for p in (out_dir / "msl").glob("*.metal")) if (out_dir / "msl").is_dir() else [],
    }
    (out_dir / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return Artifacts(out_dir, manifest)


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
