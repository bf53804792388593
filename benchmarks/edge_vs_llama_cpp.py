"""This project's Vulkan modules (IREE) against llama.cpp's Vulkan backend on the same GPU and the same
trained weights, with torch eager and torch.compile (CUDA, fp16) beside them, in one call.

    # the CPU machine (IREE's compiler): the Vulkan modules, code only
    python -m benchmarks.edge_vs_llama_cpp compile --out ART
    # the GPU machine (llama-cpp-python built with GGML_VULKAN=on, iree-base-runtime, torch, gguf)
    python -m benchmarks.edge_vs_llama_cpp run --artifacts ART --out OUT

`compile` compiles MODEL's (a LLaMA 3 shape with data=text's byte vocabulary) Vulkan modules for
--target: fp16 with edge.quant none, int8 and int4 (groups of 32, as Q4_0's blocks), each at a
prompt of 128 and of 512 tokens (`task=infer edge.action=compile`). Their parameters are not part of
them: `run` trains MODEL on data=text on the GPU (--steps), exports it (`python -m src.export`: a
safetensors file, and GGUF as F16, Q8_0 and Q4_0), and points every module at the export, whose
parameters task=infer writes there.

Then, per format pair (fp16 / F16, int8 / Q8_0, int4 / Q4_0): the time to first token at prompts of
128 and 512 (one prefill call until its token is on the host) and the decode step at batch 1 (one
call until its token is on the host), p50 over --repeats generations after --warmup, through the same
src/edge/bench.py `generate` loop for llama.cpp (benchmarks/llama_cpp_runner.py) and torch; IREE's
figures come from `task=infer edge.action=run`, whose summary times the same loop. Quality:
perplexity on the same held-out bytes (src/edge/quality.py), teacher-forced through each runner,
beside torch fp32's. llama.cpp's own clock of its calls (llama_perf_context) is printed beside its
wall times, so the Python around each call shows apart. One table, table.md and results.json under --out.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

MODEL = ["model=llama3_tiny", "model.dim=512", "model.n_layers=8", "model.n_heads=8", "model.n_kv_heads=4", "model.ffn_hidden=1408",
         "model.rope_factor=0.0"]
"""a LLaMA 3 block at 512 wide, 8 of them (25M parameters with the byte vocabulary)"""
TRAIN = ["data=text", "data.seq_len=512", "data.batch_size=32", "backend=cuda", "precision=bf16", "dist.nproc=1", "tracking=none",
         "train.progress=false", "checkpoint.enabled=true", "optim.lr=2e-3", "optim.schedule=cosine", "optim.warmup_steps=50"]
FORMATS = (("none", "f16"), ("int8", "q8_0"), ("int4", "q4_0"))
"""(edge.quant, GGUF type): the pairs compared"""
PROMPTS = (128, 512)
STEPS = 64
"""decode calls after the 128-token prompt; the 512 prompt's modules decode 1"""


def _run(cmd: list[str], cwd: Path | None = None, timeout: float = 3600) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        raise SystemExit(f"failed ({proc.returncode}): {' '.join(cmd)}\n{proc.stderr[-3000:]}")
    return proc


def compile_modules(out: Path, target: str) -> None:
    out = out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    for quant, _ in FORMATS:
        for prompt in PROMPTS:
            art = out / f"iree-{quant}-p{prompt}"
            _run([sys.executable, "-m", "src.run", "task=infer", "backend=vulkan", *MODEL, "edge.action=compile", f"edge.target={target}",
                  "edge.dtype=fp16", f"edge.quant={quant}", "edge.quant_group=32", f"edge.prompt_len={prompt}",
                  f"edge.decode_steps={STEPS if prompt == PROMPTS[0] else 1}", f"edge.artifacts={art}", "tracking=none",
                  f"hydra.run.dir={out / 'compile' / art.name}"])
            (art / "params.irpa").unlink(missing_ok=True)  # the seeded weights': run writes the trained ones
    (out / "compiled.json").write_text(json.dumps({"model": MODEL, "target": target, "formats": FORMATS, "prompts": PROMPTS}, indent=2))
    print(f"{out}: {len(FORMATS) * len(PROMPTS)} Vulkan modules for {target}")


def train_and_export(artifacts: Path, out: Path, steps: int) -> dict[str, Any]:
    """MODEL trained on data=text here, exported as safetensors and GGUF; every module pointed at it."""
    py = [sys.executable, "-m"]
    train_dir = out / "train"
    _run([*py, "src.run", *MODEL, *TRAIN, f"train.steps={steps}", f"hydra.run.dir={train_dir}"])
    step = train_dir / "checkpoints" / f"step_{steps:08d}"
    _run([*py, "src.export", str(step), "--out", str(out / "model.safetensors")])
    for _, gguf in FORMATS:
        _run([*py, "src.export", str(step), "--gguf", gguf, "--out", str(out / f"model-{gguf}.gguf")])
    for art in artifacts.glob("iree-*"):
        manifest = json.loads((art / "manifest.json").read_text())
        manifest["weights"] = {"safetensors": str(out / "model.safetensors")}
        (art / "manifest.json").write_text(json.dumps(manifest, indent=2))
        (art / "params.irpa").unlink(missing_ok=True)
    summary = json.loads((train_dir / "summary.json").read_text())
    return {k: summary.get(k) for k in ("final_loss", "tokens_per_s", "steps")}


def _edge_run(art: Path, out: Path, flags: list[str]) -> dict[str, Any]:
    """This project's module through task=infer edge.action=run: its summary (timings, perplexity)."""
    run_dir = out / f"iree-{art.name}"
    flag_list = "[" + ",".join(f'"{f}"' for f in flags) + "]"
    manifest = json.loads((art / "manifest.json").read_text())
    steps = manifest["max_seq"] - manifest["prompt_len"]  # the decode steps its cache holds
    proc = subprocess.run([sys.executable, "-m", "src.run", "task=infer", "backend=vulkan", *MODEL, "edge.action=run", f"edge.artifacts={art}",
                           f"edge.decode_steps={steps}", f"edge.runtime_flags={flag_list}", "tracking=none", f"hydra.run.dir={run_dir}"],
                          capture_output=True, text=True, timeout=900)
    path = run_dir / "summary.json"
    if proc.returncode != 0 or not path.is_file():
        return {"error": (proc.stderr.strip().splitlines() or ["no output"])[-1][:300]}
    return json.loads(path.read_text())


def _timed(runner: Any, tokens, steps: int, warmup: int, repeats: int) -> dict[str, float]:
    from src.edge.bench import generate

    for _ in range(warmup):
        generate(runner, tokens, steps)
    gens = [generate(runner, tokens, steps) for _ in range(repeats)]
    out = {"ttft_p50_ms": statistics.median(g.prefill_ms for g in gens)}
    if steps:
        out["decode_p50_ms"] = statistics.median(t for g in gens for t in g.decode_ms)
    return out


def _llama_cpp(gguf: Path, tokens_by_prompt: dict[int, Any], quality_tokens, warmup: int, repeats: int) -> dict[str, Any]:
    from benchmarks.llama_cpp_runner import LlamaCppRunner
    from src.edge.quality import perplexity

    runner = LlamaCppRunner(gguf, n_ctx=1024)
    row: dict[str, Any] = {"device": runner.device()}
    for prompt, tokens in tokens_by_prompt.items():
        runner.reset_timings()
        figures = _timed(runner, tokens, STEPS if prompt == PROMPTS[0] else 0, warmup, repeats)
        own = runner.timings()
        row[f"ttft_p{prompt}_ms"] = figures["ttft_p50_ms"]
        row[f"own_prompt_p{prompt}_ms"] = own["prompt_ms"] / max(1, warmup + repeats)  # llama.cpp's clock, mean per prefill
        if "decode_p50_ms" in figures:
            row["decode_ms"] = figures["decode_p50_ms"]
            row["own_decode_ms"] = own["decode_ms"] / max(1, own["decode_calls"])
    row["perplexity"] = perplexity(runner, quality_tokens, PROMPTS[0])
    return row


def _torch(art: Path, tokens_by_prompt: dict[int, Any], quality_tokens, compiled: bool, warmup: int, repeats: int) -> dict[str, Any]:
    import torch

    from src.edge.quality import torch_perplexity
    from src.edge.runtime import TorchRunner
    from src.edge.task import reference_model

    manifest = json.loads((art / "manifest.json").read_text())
    reference = reference_model(manifest["model"], manifest["weights"], max(PROMPTS) + STEPS + 1, 1)
    row: dict[str, Any] = {"device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"}
    if not compiled:
        row["perplexity_fp32"] = torch_perplexity(reference, quality_tokens, PROMPTS[0])
    runner = TorchRunner(reference, "cuda" if torch.cuda.is_available() else "cpu", "fp16", 1, compiled=compiled)
    for prompt, tokens in tokens_by_prompt.items():
        figures = _timed(runner, tokens, STEPS if prompt == PROMPTS[0] else 0, warmup, repeats)
        row[f"ttft_p{prompt}_ms"] = figures["ttft_p50_ms"]
        if "decode_p50_ms" in figures:
            row["decode_ms"] = figures["decode_p50_ms"]
    return row


def _error(err: Exception) -> dict[str, str]:
    """A row that failed, in one line: the rest of the grid goes on."""
    return {"error": f"{type(err).__name__}: {str(err).splitlines()[0][:300] if str(err) else ''}"}


def _fmt(v: Any, spec: str = ".3f") -> str:
    return "-" if v is None else format(v, spec) if isinstance(v, float) else str(v)


def markdown(rows: list[dict[str, Any]]) -> str:
    lines = ["| runner | format | decode ms | ttft 128 ms | ttft 512 ms | perplexity | llama.cpp's own decode / prompt 512 ms |",
             "|---|---|---:|---:|---:|---:|---|"]
    for r in rows:
        own = f"{_fmt(r.get('own_decode_ms'))} / {_fmt(r.get('own_prompt_p512_ms'))}" if "own_decode_ms" in r else ""
        lines.append(f"| {r['runner']} | {r['format']} | {_fmt(r.get('decode_ms'))} | {_fmt(r.get('ttft_p128_ms'))} | "
                     f"{_fmt(r.get('ttft_p512_ms'))} | {_fmt(r.get('perplexity'))} | {own or r.get('error', '')} |")
    return "\n".join(lines)


def run(artifacts: Path, out: Path, steps: int, warmup: int, repeats: int, flags: list[str]) -> list[dict[str, Any]]:
    from src.config.compose import compose_config
    from src.edge.quality import held_out_tokens

    artifacts, out = artifacts.resolve(), out.resolve()
    out.mkdir(parents=True, exist_ok=True)
    trained = train_and_export(artifacts, out, steps)
    print(f"trained {steps} steps: {trained}", flush=True)
    corpus_mb = float(compose_config([*MODEL, *TRAIN]).data.corpus_mb)  # the held-out text starts after what training read
    tokens_by_prompt = {p: held_out_tokens(1, p, corpus_mb + 0.05 * (i + 1)) for i, p in enumerate(PROMPTS)}  # timing prompts, apart from the scored text
    quality_tokens = held_out_tokens(1, PROMPTS[0] + STEPS + 1, corpus_mb)
    rows: list[dict[str, Any]] = []
    for quant, gguf in FORMATS:
        for runner in ("iree", "llama.cpp"):
            t0 = time.perf_counter()
            try:
                if runner == "iree":
                    got = {p: _edge_run(artifacts / f"iree-{quant}-p{p}", out, flags) for p in PROMPTS}
                    first = got[PROMPTS[0]]
                    row = {"error": first["error"]} if "error" in first else {
                        "device": first.get("device_name"), "decode_ms": first.get("decode_p50_ms"), "perplexity": first.get("perplexity"),
                        "perplexity_fp32": first.get("perplexity_fp32"),
                        **{f"ttft_p{p}_ms": got[p].get("ttft_p50_ms") for p in PROMPTS}}
                else:
                    row = _llama_cpp(out / f"model-{gguf}.gguf", tokens_by_prompt, quality_tokens, warmup, repeats)
            except Exception as err:  # one failed row, the rest go on
                row = _error(err)
            rows.append({"runner": runner, "format": quant if runner == "iree" else gguf, "seconds": time.perf_counter() - t0, **row})
            print(json.dumps(rows[-1]), flush=True)
    for compiled in (False, True):
        try:
            row = _torch(artifacts / f"iree-none-p{PROMPTS[0]}", tokens_by_prompt, quality_tokens, compiled, warmup, repeats)
        except Exception as err:
            row = _error(err)
        rows.append({"runner": "torch.compile" if compiled else "torch eager", "format": "fp16", **row})
        print(json.dumps(rows[-1]), flush=True)
    table = markdown(rows)
    print(table)
    (out / "table.md").write_text(table + "\n")
    (out / "results.json").write_text(json.dumps({"trained": trained, "rows": rows}, indent=2))
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.edge_vs_llama_cpp", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("compile", help="the Vulkan modules, code only (the CPU machine, IREE's compiler)")
    c.add_argument("--out", type=Path, required=True)
    c.add_argument("--target", default="sm_60", help="edge.target of the Vulkan modules (sm_60, no cooperative matrices: what NVIDIA's driver takes in fp16)")
    r = sub.add_parser("run", help="time and score every format on this GPU (the GPU machine)")
    r.add_argument("--artifacts", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True)
    r.add_argument("--steps", type=int, default=600, help="training steps on data=text before the export")
    r.add_argument("--warmup", type=int, default=2)
    r.add_argument("--repeats", type=int, default=10)
    r.add_argument("--runtime-flags", default="--vulkan_tracing=false", help="IREE runtime flags, comma-separated")
    args = ap.parse_args(argv)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    if args.cmd == "compile":
        compile_modules(args.out, args.target)
    else:
        run(args.artifacts, args.out, args.steps, args.warmup, args.repeats, [f for f in args.runtime_flags.split(",") if f])


if __name__ == "__main__":
    main()
