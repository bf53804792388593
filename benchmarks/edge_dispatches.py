"""Where a Vulkan decode step's (or prefill's) GPU time goes: every dispatch, timed by the device.

    python -m benchmarks.edge_dispatches --module ARTIFACTS/small-fp16-b1-pascal-nocoop \\
        --calls 20 --json OUT/dispatches.json [--function prefill]

Runs the module's `decode` (or `prefill`, its prompt one token repeated; parameters written from the seeded initialisation where the module
has none) `--calls` times under `iree-benchmark-module` with IREE's HAL profiling on
(`--device_profiling_mode=dispatch-events`: a device timestamp before and after each dispatch),
then reads the capture with `iree-profile statistics`. Prints each executable's GPU time per
decode call, how many times a call dispatches it, and its share, largest first, and their sum:
against the decode step that `benchmarks.edge_roundtrip` measures with the calls queued back to
back (GPU and queue together), the rest is what the queue and the barriers between dispatches
cost. An executable is named after the first function that used it: one of prefill's may run
in decode too (the head and its argmax).
"""
from __future__ import annotations

import argparse
import copy
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROW = re.compile(r"^\s*dispatch (\S+)\s+count=(\d+) total=([\d.]+) (ns|us|ms|s) avg=")
UNIT_US = {"ns": 1e-3, "us": 1.0, "ms": 1e3, "s": 1e6}


def parse_statistics(text: str, calls: int) -> list[dict]:
    """`iree-profile statistics` text -> one row per executable: dispatches and GPU us per call."""
    rows = []
    for line in text.splitlines():
        m = ROW.match(line)
        if m:
            name, count, total, unit = m.group(1), int(m.group(2)), float(m.group(3)), m.group(4)
            rows.append({"dispatch": name, "per_call": count / calls, "us_per_call": total * UNIT_US[unit] / calls})
    rows.sort(key=lambda r: -r["us_per_call"])
    return rows


def _tool(name: str) -> str:
    import iree._runtime_libs as libs

    return str(Path(libs.__file__).parent / name)


def profile(module: Path, calls: int, flags: list[str], work: Path, function: str = "decode") -> list[dict]:
    from src.dtypes import torch_dtype
    from src.edge.compile import load_artifacts
    from src.edge.params import write_params
    from src.edge.runtime import on_lavapipe, run_tool
    from src.edge.task import reference_model

    art = load_artifacts(module)
    m = art.manifest
    params = art.irpa
    if not params.is_file():
        reference = reference_model(m["model"], m["weights"] or {"seed": 0}, m["max_seq"], m["batch"])
        params = work / "params.irpa"
        write_params(copy.deepcopy(reference).to(torch_dtype(m["dtype"])), params)
    capture = work / f"{function}.ireeprof"
    batch = m["batch"]
    # a splat: every token 5 (the prompt, or each sequence's token); decode at the prompt's end
    inputs = [f"--input={batch}x{m['prompt_len']}xi32=5"] if function == "prefill" else [f"--input={batch}xi32=5", f"--input=1xi32={m['prompt_len']}"]
    cmd = [_tool("iree-benchmark-module"), f"--module={module / 'module.vmfb'}", f"--parameters=model={params}", "--device=vulkan",
           f"--function={function}", *inputs, f"--benchmark_min_time={calls}x",
           "--device_profiling_mode=dispatch-events", f"--device_profiling_output={capture}", *flags]
    proc = run_tool(cmd, on_lavapipe(), timeout=300)
    if proc.returncode or not capture.is_file():
        raise RuntimeError(f"iree-benchmark-module exited {proc.returncode}{'' if capture.is_file() else ', no capture written'}: "
                           f"{(proc.stderr or proc.stdout).strip()[-500:]}")
    stats = subprocess.run([_tool("iree-profile"), "statistics", str(capture)], capture_output=True, text=True, timeout=120)
    return parse_statistics(stats.stdout, calls)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--module", type=Path, action="append", required=True, help="a module directory of `edge_vs_torch compile` (repeat)")
    ap.add_argument("--calls", type=int, default=20)
    ap.add_argument("--function", default="decode", choices=("decode", "prefill"), help="the entry point timed")
    ap.add_argument("--flag", action="append", default=[], help="IREE runtime flag (repeat)")
    ap.add_argument("--top", type=int, default=15, help="rows shown per module (the JSON holds all)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args(argv)
    results, failed = {}, False
    for module in args.module:
        with tempfile.TemporaryDirectory() as work:
            try:
                rows = profile(module, args.calls, args.flag, Path(work), args.function)
            except (RuntimeError, subprocess.TimeoutExpired) as err:
                print(f"{module.name}: {err}", flush=True)
                failed = True
                continue
        results[module.name] = rows
        total = sum(r["us_per_call"] for r in rows)
        print(f"\n{module.name}: {sum(r['per_call'] for r in rows):.0f} dispatches, {total / 1e3:.3f} ms of GPU time per {args.function} call\n")
        print("| dispatch | per call | GPU us per call | share |\n|---|---:|---:|---:|")
        for r in rows[: args.top]:
            print(f"| {r['dispatch'][-70:]} | {r['per_call']:.0f} | {r['us_per_call']:.1f} | {100 * r['us_per_call'] / max(total, 1e-9):.1f}% |")
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
