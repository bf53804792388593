"""Vulkan (IREE) against torch CUDA eager on one GPU, side by side, from modules compiled elsewhere.

    # here, on the CPU machine (IREE compiler): code only, no parameters, a few MiB in all
    python -m benchmarks.edge_vs_torch compile --out edge_artifacts
    # on the GPU machine (iree-base-runtime, torch; no compiler): parameters written there
    python -m benchmarks.edge_vs_torch run --artifacts edge_artifacts --out OUT

The grid (issue 13): model=tiny at dim 256 / 2 layers / vocab 4096 / 4 heads and model=small,
fp32 and fp16, batch 1 and 4, prompt 32 then 32 greedy decode steps. fp16 comes in the variants
that separate the failing dispatch on NVIDIA's driver: `ampere` (cooperative matrices, tiles sized
for 163 KiB of shared memory), `turing` (cooperative matrices, 64 KiB), `pascal` (no cooperative
matrices, 48 KiB, the budget NVIDIA's Vulkan driver reports as maxComputeSharedMemorySize). Which
of them load says whether the matrix units or the tile sizes are what the driver refuses. Each
module records whether its SPIR-V declares CooperativeMatrixKHR (manifest `cooperative_matrix`).
Vulkan modules are compiled without growing hoists (NO_GROWING_HOISTS, src/edge/compile.py), which
takes the copy of a hoisted constant, and the GPU wait it brings, out of each decode call; the
`growhoist` variants (fp32 ampere, fp16 pascal, batch 1) keep IREE's default hoisting for
comparison. Each module's manifest records the queue ops of decode and of decode_token
(`decode_queue_ops`, `decode_token_queue_ops`; the timed steps call decode_token) and its hoisting.

`run` times every module on Vulkan and every (model, dtype, batch) on torch eager, each in its own
process under a timeout, so a module that hangs or crashes the driver is one row marked failed and
the rest go on; it prints one markdown table and writes table.md and results.json to --out.

`compile --grid issue57` is issue 57's grid instead: weight-only int8 and int4 (edge.quant,
src/edge/quant.py) beside fp16 on `model=small` at batch 1 and 4, batch 4 through the matvec
kernels (edge.matvec_rows=4, src/edge/matvec.py) and once through IREE's general matmul for the
comparison; a 128-token prompt (time to first token at 128) with IREE's tiles and with the
prefill's products tiled 16 x 64 and 32 x 64 (src/edge/tiles.py); and `model=mini_llm` (735M
parameters) at batch 1. Its modules are code only
as every module here: the parameters (1.47 GB for mini_llm in fp16) are the seeded initialisation,
generated and quantized on the GPU machine and written there as an .irpa before each run. Its
torch rows are fp16 eager (the unquantized model: what a quantized module has to beat), and with
`run --torch-compile`, torch.compile on the same model. `--hbm-gbps` gives each Vulkan row the
memory floor's share: the bytes of the weights a decode step reads (quantized blocks, the head;
the embedding's one row left out) over the peak bandwidth, against the step's p50.
"""
from __future__ import annotations

import argparse
import json
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any, NamedTuple

from src.edge.compile import GROWING_HOISTS

PROMPT, STEPS = 32, 32
MODELS = {  # the shapes of issue 13; the rest of each config from MiniLLM's (src/models/mini_llm/config.py)
    "tiny": {"name": "tiny", "vocab_size": 4096, "dim": 256, "n_layers": 2, "n_heads": 4},
    "small": {"name": "small", "vocab_size": 32000, "dim": 512, "n_layers": 4, "n_heads": 8},
    # docs/SEED.md's MiniLLM (conf/model/mini_llm.yaml): issue 57's grid only
    "mini_llm": {"name": "mini_llm", "vocab_size": 32000, "dim": 2048, "n_layers": 12, "n_heads": 16},
}
# (dtype, target, extra flags, batches): what each variant is for is in the module docstring
VARIANTS = [
    ("fp32", "ampere", (), (1, 4)),
    ("fp16", "ampere", (), (1,)),  # the recorded failure: NVIDIA 580.159.04 refuses its pipelines (turing, 64 KiB tiles, too)
    ("fp16", "pascal", (), (1, 4)),
    # IREE's default hoisting, whose hoisted scatter-index copy stalls each decode call on the GPU
    # (src/edge/compile.py): 3 alloca, copy, 2 dealloca, barrier against the default's 2 alloca, 1 dealloca
    ("fp32", "ampere", (GROWING_HOISTS,), (1,)),
    ("fp16", "pascal", (GROWING_HOISTS,), (1,)),
]


class Variant(NamedTuple):
    """A module of issue 57's grid: `models` (None: every model of --models), its weights' format
    (edge.quant), the prompt (its time to first token) and the decode steps after it."""
    dtype: str
    target: str
    flags: tuple[str, ...]
    batches: tuple[int, ...]
    quant: str = "none"
    prompt: int = PROMPT
    steps: int = STEPS
    models: tuple[str, ...] | None = None
    matvec_rows: int = 0
    """edge.matvec_rows for its batches above 1 (src/edge/matvec.py)"""
    tiles: tuple[int, int] | None = None
    """the prefill's matmul tiles, M x N (src/edge/tiles.py); None: IREE's own"""


QUANT_GROUP = 32  # src/edge/quant.py DEFAULT_GROUP: 0.25 relative error on small against 0.33 at 128
# fp16 as `pascal` (no cooperative matrices: the driver refuses `ampere`'s fp16 pipelines, above).
# Decode at a 32-token prompt: at 128, small's fp16 prefill does not compile without growing hoists
# (`memref.alloc ... memref<128xindex>`), and IREE's default hoisting then moves each weight's
# dequantization into the initializer (the calls read fp16: no quantized decode to time) and adds
# a copy to each decode call (7.2 against 5.8 ms, benchmarks/notes/PERFORMANCE.md 6d). So the prompt-128
# modules are for the time to first token, fp16 and int8 at batch 1.
# mini_llm at batch 1: its fp32 reference (the error figures) runs three generations per row.
ISSUE57 = [
    # batch 4 through the matvec kernels (edge.matvec_rows=4), and once without for the comparison
    *(Variant("fp16", "pascal", (), (1, 4), quant, PROMPT, STEPS, ("small",), matvec_rows=4) for quant in ("none", "int8", "int4")),
    Variant("fp16", "pascal", (), (4,), "none", PROMPT, STEPS, ("small",)),
    # the time to first token at 128: IREE's tiles, and the prefill's products on 4-16x the workgroups
    *(Variant("fp16", "pascal", (), (1,), quant, 128, STEPS, ("small",)) for quant in ("none", "int8")),
    *(Variant("fp16", "pascal", (), (1,), "none", 128, STEPS, ("small",), tiles=tiles) for tiles in ((16, 64), (32, 64))),
    *(Variant("fp16", "pascal", (), (1,), quant, PROMPT, STEPS, ("mini_llm",)) for quant in ("none", "int8", "int4")),
]
GRIDS = {"issue13": [Variant(*v) for v in VARIANTS], "issue57": ISSUE57}
# Left out after the 2026-11-30 run (benchmarks/notes/PERFORMANCE.md 6b): --iree-opt-level=O3 does not compile
# in IREE 3.13, --iree-vulkan-dispatch-abi=bda gives wrong numbers on NVIDIA's driver.
# IREE runtime flag sets each Vulkan module runs under (`run --runtime-flags`): the per-call event
# timestamps (vulkan_tracing) are a host cost per submit: 0.15-2.65 ms of a decode step, either way, on an
# H200 (2026-12-05); the dedicated compute queue's set was level with the second in every row and is gone.
RUNTIME_FLAGS = ["", "--vulkan_tracing=false"]
COMPILE_FAILURES = "compile_failures.json"
COLUMNS = ["backend", "device", "model", "dtype", "quant", "batch", "prompt", "variant", "TTFT p50 ms", "decode p50 ms", "call ms", "read ms",
           "prefill tok/s", "decode tok/s", "floor share", "max rel err", "same tokens", "status"]


def model_config(name: str, overrides: dict | None = None) -> dict:
    from dataclasses import asdict

    from src.models.mini_llm.config import MiniLLMConfig

    return asdict(MiniLLMConfig(**{**MODELS[name], **(overrides or {})}))


def compile_grid(out: Path, target_map: dict[str, str], models: list[str], variants: list[Variant], cache_dir: Path) -> list[Path]:
    """Every module of the grid under `out`, one directory each, without parameters."""
    from iree.compiler.tools.binaries import CompilerToolError

    from src.edge.compile import build, compile_error_line, default_variant
    from src.edge.matvec import use_matvec
    from src.edge.quant import fuse_dequantization
    from src.edge.task import deployed, quant_setting, reference_model
    from src.edge.tiles import prefill_tiles_flag

    made, failures = [], []
    for model in models:
        cfg = model_config(model)
        for v in variants:
            if v.models is not None and model not in v.models:
                continue
            target = target_map.get(v.target, v.target)
            quant = quant_setting(v.quant, QUANT_GROUP, fuse_dequantization("vulkan", target))
            for batch in v.batches:
                lm = deployed(reference_model(cfg, {"seed": 0}, v.prompt + v.steps, batch), {"dtype": v.dtype, "quant": quant})
                rows = v.matvec_rows if batch > 1 else 0  # one row is a matvec already
                use_matvec(lm, rows)
                flags = tuple(v.flags)
                if v.tiles is not None:  # the projections' batch of 1 and attention's sequences x heads
                    flags += (prefill_tiles_flag(cache_dir / "tiles", batch * v.prompt, v.tiles, v.dtype, (1, batch * cfg["n_heads"])),)
                t0 = time.perf_counter()
                try:
                    art = build(lm, cfg, v.prompt, v.dtype, "vulkan", target, "", out / "_staging", cache_dir, {"seed": 0}, flags, params=False)
                except CompilerToolError as err:  # a row of its own in the run's table, not the end of the grid
                    error = compile_error_line(err)
                    variant = default_variant(target, False, flags, quant, rows).replace("-nocoop", "")
                    failures.append({"backend": "vulkan", "model": model, "dtype": v.dtype, "quant": v.quant, "batch": batch, "prompt_len": v.prompt,
                                     "variant": variant, "status": "failed", "error": f"does not compile: {error[:300]}"})
                    print(f"{model}-{v.dtype}-b{batch}-{variant}: does not compile: {error[:200]}", flush=True)
                    continue
                del lm
                prompt = f"-p{v.prompt}" if v.prompt != PROMPT else ""
                name = f"{model}-{v.dtype}-b{batch}{prompt}-{art.manifest['variant']}"
                dest = out / name
                dest.mkdir(parents=True, exist_ok=True)
                for f in ("module.vmfb", "manifest.json"):
                    (art.dir / f).replace(dest / f)
                print(f"{name}: {art.manifest['module_bytes'] / 1e6:.2f} MB, coop={art.manifest['cooperative_matrix']}, "
                      f"decode queue ops {art.manifest['decode_queue_ops']}, {time.perf_counter() - t0:.0f} s", flush=True)
                made.append(dest)
    (out / COMPILE_FAILURES).write_text(json.dumps(failures, indent=2))
    (out / "_staging").rmdir() if (out / "_staging").is_dir() and not any((out / "_staging").iterdir()) else None
    return made


HOST_WAIT = "--host_wait="
TOKEN_OUT = "--token_out="


def run_one(module: Path, backend: str, work: Path, repeats: int, warmup: int, flags: tuple[str, ...] = ()) -> dict[str, Any]:
    """One combination in this process: the summary dict (status finished or failed, error)."""
    import torch

    from src.edge.compile import load_artifacts
    from src.edge.params import write_params
    from src.edge.quant import weight_bytes
    from src.edge.task import EdgeRunFailed, _run, deployed, reference_model

    art = load_artifacts(module)
    m = art.manifest
    settings = {k: m[k] for k in ("batch", "prompt_len", "max_seq", "dtype", "model", "weights")}
    # torch's rows: the unquantized model (run only from a quant-none module, run_grid)
    settings["quant"] = (m.get("quant") or {"format": "none"}) if backend == "vulkan" else {"format": "none"}
    t0 = time.perf_counter()
    reference = reference_model(m["model"], m["weights"], m["max_seq"], m["batch"])
    compiled = backend == "cuda-compile"
    summary: dict[str, Any] = {"backend": backend, "model": m["model"]["name"], "dtype": m["dtype"], "quant": settings["quant"]["format"],
                               "batch": m["batch"], "prompt_len": m["prompt_len"], "decode_steps": m["max_seq"] - m["prompt_len"],
                               "variant": flagged(m["variant"], flags) if backend == "vulkan" else "compile" if compiled else "eager",
                               "target": m["target"] if backend == "vulkan" else None, "device_name": backend, "status": "finished",
                               "init_s": time.perf_counter() - t0}
    held = deployed(reference, settings)
    summary.update(weight_bytes(held), hoisting=m.get("hoisting") if backend == "vulkan" else None)
    if backend == "vulkan":
        art.params = work / f"{module.name}.irpa"
        t0 = time.perf_counter()
        write_params(held, art.params)
        summary["params_write_s"] = time.perf_counter() - t0
    del held
    if torch.cuda.is_available() and m["model"]["dim"] >= 1024:
        # mini_llm's fp32 reference on the CPU: 2.9 GB of weights read per step, three generations
        # a row (the error, torch's greedy tokens, the quantized model's); on the GPU in fp32 (TF32 off)
        torch.backends.cuda.matmul.allow_tf32 = False
        reference = reference.to("cuda")
    # `--host_wait=poll|block` and `--token_out=caller|result` ride with the runtime flags
    # (edge.host_wait, edge.token_out), the rest are IREE's
    waits = [f.split("=", 1)[1] for f in flags if f.startswith(HOST_WAIT)]
    outs = [f.split("=", 1)[1] for f in flags if f.startswith(TOKEN_OUT)]
    e = SimpleNamespace(seed=0, decode_steps=m["max_seq"] - m["prompt_len"], warmup=warmup, repeats=repeats,
                        runtime_flags=tuple(f for f in flags if not f.startswith((HOST_WAIT, TOKEN_OUT))),
                        host_wait=waits[-1] if waits else "auto", token_out=outs[-1] if outs else "caller", torch_compile=compiled)
    try:
        _run("cuda" if compiled else backend, art, reference, settings, e, summary)
    except EdgeRunFailed as err:
        summary.update(status="failed", error=str(err))
    finally:
        if art.params is not None:
            art.params.unlink(missing_ok=True)
    summary.pop("rel_err_per_step", None)
    summary.pop("generated", None)
    summary["backend"] = backend
    return summary


def flagged(variant: str, flags: tuple[str, ...] | list[str]) -> str:
    """The variant's name with its runtime flags: `pascal-nocoop+vulkan_tracing=false`."""
    return "+".join([variant, *(f.removeprefix("--") for f in flags)])


def _fmt(value: Any, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def floor_share(r: dict[str, Any], hbm_gbps: float) -> float | None:
    """The weights-read floor of a decode step over its p50: the block weights as stored plus the
    head (vocab x dim in the dtype), read once a step; the embedding's one row a token left out."""
    if not (hbm_gbps and r.get("decode_p50_ms") and r.get("block_weight_bytes")):
        return None
    cfg = MODELS.get(r["model"], {})
    head = cfg.get("vocab_size", 0) * cfg.get("dim", 0) * (2 if r["dtype"] in ("fp16", "bf16") else 4)
    return (r["block_weight_bytes"] + head) / (hbm_gbps * 1e9) * 1e3 / r["decode_p50_ms"]


def row(r: dict[str, Any], hbm_gbps: float = 0.0) -> str:
    status = r["status"] if r["status"] == "finished" else f"FAILED: {r.get('error', '')[:160]}"
    same = f"{r['same_tokens_steps']}/{r['decode_steps'] + 1}" if r.get("same_tokens_steps") is not None and r.get("decode_steps") is not None else "n/a"
    cells = [r["backend"], r.get("device_name", "?"), r["model"], r["dtype"], r.get("quant", "none"), str(r["batch"]), str(r.get("prompt_len", PROMPT)),
             r["variant"], _fmt(r.get("ttft_p50_ms"), ".3f"), _fmt(r.get("decode_p50_ms"), ".3f"), _fmt(r.get("decode_call_ms"), ".3f"),
             _fmt(r.get("token_read_ms"), ".3f"), _fmt(r.get("prefill_tokens_per_s"), ",.0f"), _fmt(r.get("decode_tokens_per_s"), ",.0f"),
             _fmt(floor_share(r, hbm_gbps), ".2f"), _fmt(r.get("rel_err"), ".2e"), same, status.replace("|", "/")]
    return "| " + " | ".join(cells) + " |"


def markdown(results: list[dict[str, Any]], hbm_gbps: float = 0.0) -> str:
    lines = ["| " + " | ".join(COLUMNS) + " |",
             "|" + "|".join("---:" if c.endswith(("ms", "tok/s", "err", "share")) or c in ("batch", "prompt") else "---" for c in COLUMNS) + "|"]
    lines += [row(r, hbm_gbps) for r in results]
    ratios = []
    for r in results:  # Vulkan's p50s over torch eager's, same model, dtype, batch and prompt (torch unquantized)
        key = (r["model"], r["dtype"], r["batch"], r.get("prompt_len", PROMPT))
        base = next((b for b in results if b["backend"] in ("cuda", "cpu") and (b["model"], b["dtype"], b["batch"], b.get("prompt_len", PROMPT)) == key), None)
        if r["backend"] == "vulkan" and base and r.get("decode_p50_ms") and base.get("decode_p50_ms"):
            ttft = f"{r['ttft_p50_ms'] / base['ttft_p50_ms']:.2f}x" if r.get("ttft_p50_ms") and base.get("ttft_p50_ms") else "n/a"
            ratios.append(f"| {r['model']} | {r['dtype']} | {r.get('quant', 'none')} | {r['batch']} | {key[3]} | {r['variant']} | "
                          f"{r['decode_p50_ms'] / base['decode_p50_ms']:.2f}x | {ttft} |")
    if ratios:
        lines += ["", "| model | dtype | quant | batch | prompt | variant | Vulkan / torch eager decode p50 | TTFT p50 |", "|---|---|---|---:|---:|---|---:|---:|", *ratios]
    return "\n".join(lines)


def crash_line(stderr: str, limit: int = 400) -> str:
    """Where a `one` process died and why, in one line, from its stderr: the error with the
    innermost frame of its traceback (or of faulthandler's dump after a fatal signal), so the row
    says `RuntimeError: std::bad_cast at src/edge/runtime.py:62 in _target`, not the error alone."""
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    if not lines:
        return "no output"
    fatal = next((i for i, line in enumerate(lines) if line.startswith("Fatal Python error")), None)
    if fatal is not None:  # faulthandler: the innermost frame is the first after the header
        frame = next((line for line in lines[fatal:] if line.startswith("File ")), "")
        error = lines[fatal]
    else:
        frame = next((line for line in reversed(lines) if line.startswith("File ")), "")
        error = lines[-1]
    where = re.match(r'File "(.+?)", line (\d+),? in (\S+)', frame)
    text = error + (f" at {_repo_relative(where[1])}:{where[2]} in {where[3]}" if where else "")
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _repo_relative(path: str) -> str:
    root = str(Path(__file__).resolve().parents[2]) + "/"
    return path.removeprefix(root)


def run_grid(artifacts: Path, out: Path, torch_backend: str, timeout_s: float, budget_s: float, repeats: int, warmup: int,
             runtime_flags: list[str] = ("",), models: str = "", torch_compile: bool = False, hbm_gbps: float = 0.0) -> list[dict[str, Any]]:
    manifests = {p.parent: json.loads(p.read_text()) for p in artifacts.glob("*/manifest.json")}
    # the 32-token prompts' decode first, the longer prompts' time to first token after: what a spent budget skips
    modules = sorted(manifests, key=lambda p: (manifests[p]["prompt_len"] != PROMPT, p.name))
    if models:
        modules = [p for p in modules if manifests[p]["model"]["name"] in models.split(",")]
    if not modules:
        raise SystemExit(f"error: --artifacts {artifacts}: no module directories with a manifest.json; make them with `compile --out {artifacts}`")
    jobs: list[tuple[Path, str, tuple[str, ...]]] = []
    seen = set()
    for module in modules:
        m = manifests[module]
        key = (m["model"]["name"], m["dtype"], m["batch"], m["prompt_len"])
        # torch once per shape, unquantized: a quant-none module's (its rows come first)
        if torch_backend != "none" and key not in seen and (m.get("quant") or {}).get("format", "none") == "none":
            seen.add(key)
            jobs.append((module, torch_backend, ()))
            if torch_compile and torch_backend == "cuda":
                jobs.append((module, "cuda-compile", ()))
        jobs += [(module, "vulkan", tuple(flags.split())) for flags in runtime_flags]
    out.mkdir(parents=True, exist_ok=True)
    results, start = [], time.perf_counter()
    with tempfile.TemporaryDirectory() as work:
        for module, backend, flags in jobs:
            m = manifests[module]
            base = {"backend": backend, "model": m["model"]["name"], "dtype": m["dtype"], "batch": m["batch"], "prompt_len": m["prompt_len"],
                    "quant": (m.get("quant") or {}).get("format", "none") if backend == "vulkan" else "none",
                    "variant": flagged(m["variant"], flags) if backend == "vulkan" else backend.removeprefix("cuda-") if "-" in backend else "eager",
                    "status": "failed"}
            left = budget_s - (time.perf_counter() - start)
            if left < 10:
                results.append({**base, "error": f"skipped: the {budget_s:.0f} s budget is spent"})
                continue
            result_file = Path(work) / "result.json"
            result_file.unlink(missing_ok=True)
            cmd = [sys.executable, "-X", "faulthandler", "-m", "benchmarks.edge_vs_torch", "one", "--module", str(module), "--backend", backend,
                   "--work", work, "--json", str(result_file), "--repeats", str(repeats), "--warmup", str(warmup), *(f"--flag={f}" for f in flags)]
            t0 = time.perf_counter()
            try:
                proc = subprocess.run(cmd, capture_output=True, text=True, timeout=min(timeout_s, left))
                if result_file.is_file():
                    result = {**base, **json.loads(result_file.read_text())}
                else:
                    result = {**base, "error": f"exit {proc.returncode}: {crash_line(proc.stderr or proc.stdout)}"}
            except subprocess.TimeoutExpired:
                result = {**base, "error": f"timed out after {min(timeout_s, left):.0f} s"}
            result["wall_s"] = time.perf_counter() - t0
            results.append(result)
            print(row(result, hbm_gbps), flush=True)
            (out / "results.json").write_text(json.dumps(results, indent=2, default=str))  # kept as it grows: a killed call still leaves rows
    failed_compiles = artifacts / COMPILE_FAILURES
    results += json.loads(failed_compiles.read_text()) if failed_compiles.is_file() else []
    table = markdown(results, hbm_gbps)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str))
    return results


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="step", required=True)
    c = sub.add_parser("compile", help="compile the grid's modules (CPU machine, IREE compiler)")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--models", default="tiny,small", help="issue57: small,mini_llm")
    c.add_argument("--grid", default="issue13", choices=sorted(GRIDS), help="issue13: the dtype/target variants; issue57: quantized weights, prompt 128, mini_llm")
    c.add_argument("--target", default="", help="one Vulkan target for every variant (llvmpipe: the grid for lavapipe, to prove the run step)")
    c.add_argument("--quick", action="store_true", help="two modules: fp32 at batch 1 and fp16 at batch 2, the first variant of each")
    c.add_argument("--model-overrides", default="{}", help="JSON merged into every model config, e.g. smaller shapes for a check on lavapipe")
    c.add_argument("--cache-dir", type=Path, default=Path("~/.cache/perflab/edge").expanduser())
    r = sub.add_parser("run", help="time every module on Vulkan and on torch (the GPU machine)")
    r.add_argument("--artifacts", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--torch", default="cuda", choices=["cuda", "cpu", "none"], help="the torch eager baseline's device")
    r.add_argument("--torch-compile", action="store_true", help="torch.compile on CUDA too, beside eager (its compile in the row's time budget)")
    r.add_argument("--models", default="", help="only these models' modules (comma-separated)")
    r.add_argument("--hbm-gbps", type=float, default=0.0, help="peak memory bandwidth for the floor share (H200: 4800)")
    r.add_argument("--timeout-s", type=float, default=120.0, help="per combination")
    r.add_argument("--budget-s", type=float, default=540.0, help="for the whole grid: what is left is recorded as skipped")
    r.add_argument("--repeats", type=int, default=10)
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--runtime-flags", action="append", default=None, metavar="'FLAG ...'",
                   help="an IREE runtime flag set, space-separated, '' for none (repeat; each Vulkan module runs under each; "
                        "write --runtime-flags='--vulkan_tracing=false'); default: RUNTIME_FLAGS; --host_wait=poll|block in a set chooses how the host waits (edge.host_wait), --token_out=caller|result where the token goes (edge.token_out)")
    o = sub.add_parser("one", help="one combination (what run starts in a subprocess)")
    o.add_argument("--module", type=Path, required=True)
    o.add_argument("--backend", required=True)
    o.add_argument("--work", type=Path, required=True)
    o.add_argument("--json", type=Path, required=True)
    o.add_argument("--repeats", type=int, default=10)
    o.add_argument("--warmup", type=int, default=2)
    o.add_argument("--flag", action="append", default=[], help="an IREE runtime flag (repeat)")
    args = parser.parse_args(argv)
    if args.step == "compile":
        variants = GRIDS[args.grid]
        if args.quick:
            variants = [Variant("fp32", "ampere", (), (1,)), Variant("fp16", "ampere", (), (2,))]
        target_map = {v.target: args.target for v in variants} if args.target else {}
        overrides = json.loads(args.model_overrides)
        if overrides:
            for name in MODELS:
                MODELS[name] = {**MODELS[name], **overrides}
        if args.target:  # one target: the variants that differ only by target collapse into one
            variants = list({v._replace(target=args.target): None for v in variants})
        made = compile_grid(args.out, target_map, args.models.split(","), variants, args.cache_dir)
        total = sum(f.stat().st_size for d in made for f in d.iterdir())
        print(f"{len(made)} modules in {args.out}, {total / 2**20:.1f} MiB")
    elif args.step == "run":
        results = run_grid(args.artifacts, args.out, args.torch, args.timeout_s, args.budget_s, args.repeats, args.warmup, args.runtime_flags or RUNTIME_FLAGS,
                           args.models, args.torch_compile, args.hbm_gbps)
        print(markdown(results, args.hbm_gbps))
    else:
        import logging

        logging.basicConfig(level=logging.WARNING)
        args.json.write_text(json.dumps(run_one(args.module, args.backend, args.work, args.repeats, args.warmup, tuple(args.flag)), default=str))


if __name__ == "__main__":
    main()
