"""How a Vulkan decode step's time splits between the GPU and the host's waits, on one compiled module.

    python -m benchmarks.edge_roundtrip --module .campaign/edge_art/small-fp16-b1-pascal-nocoop [--module ...] [--flag=--vulkan_tracing=false]
        [--function decode --function decode_token]

Each --function is a row per module (both by default): `decode` returns the token and the logits,
`decode_token` (what the timed loop calls) the token alone, so its call allocates no logits result;
a module compiled before decode_token gets a row saying so. The module's `decode` is the
synchronous wrapper of `decode$async(token, pos, wait fence, signal fence)` (decode_token's of
`decode_token$async`): it enqueues the work and blocks in `hal.fence.await` until the device is
done. The Python API can call `decode$async` directly (VmContext.invoke with HalFence
arguments) and then wait on the signal fence itself, or poll its semaphore (HalSemaphore.query)
instead of sleeping in the driver's wait. Per module, p50 ms over --steps calls each:

- sync: the function as IreeRunner's synchronous path calls it (decode_token: the `call ms` of edge_vs_torch).
- async+wait: `$async`, then HalFence.wait on its signal fence.
- async+poll: `$async`, then a busy loop on HalSemaphore.query: what the wake-up costs.
- invoke: `$async` alone, the device idle when it starts (the previous call waited on, untimed):
  the host path of one call (invocation, queue allocas, submission, dealloca), without the wait.
- enqueue: `$async` alone, each call waiting on the one before on the device; then
  `pipelined` is the wall time of --steps such calls and one wait at the end, per step: the step
  when the host never waits (the token fed back on the device, read only at the end).
- read+wait / read+poll: a queue copy of the 4-byte token to host memory, waited on / polled
  (the `read ms` of edge_vs_torch, then its polling form).

Correctness first: the tokens of --steps synchronous steps and of as many async ones from the same
prefill must agree, else the row says so. Runs on any Vulkan device (lavapipe here, as a check of
the code path; its times are the CPU's, not a GPU's).
"""
from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np


def _p50(fn: Callable[[int], Any], n: int) -> float:
    times = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        times.append(1e3 * (time.perf_counter() - t0))
    return statistics.median(times)


def probe(module: Path, steps: int, flags: tuple[str, ...] = (), function: str = "decode_token") -> dict[str, Any]:
    import iree.runtime as rt

    from src.dtypes import torch_dtype
    from src.edge.compile import load_artifacts
    from src.edge.params import write_params
    from src.edge.runtime import IreeRunner, spin_wait
    from src.edge.task import reference_model

    art = load_artifacts(module)
    m = art.manifest
    reference = reference_model(m["model"], m["weights"] or {"seed": 0}, m["max_seq"], m["batch"])
    with tempfile.TemporaryDirectory() as work:
        if not art.irpa.is_file():
            art.params = Path(work) / "params.irpa"
            write_params(copy.deepcopy(reference).to(torch_dtype(m["dtype"])), art.params)
        runner = IreeRunner(art, "vulkan", flags=flags)
    device, context = runner.device, runner.context
    if runner.module.lookup_function(function) is None:
        raise SystemExit(f"{module}: no {function} in this module")
    decode_async = runner.module.lookup_function(f"{function}$async")
    sync = rt.FunctionInvoker(context, device, runner.module.lookup_function(function))

    def sync_call(token: Any, i: int) -> Any:
        """the function's token: decode returns (token, logits), decode_token the token"""
        out = sync(token, runner.positions[m["prompt_len"] + i % (m["max_seq"] - m["prompt_len"])])
        return out[0] if isinstance(out, tuple) else out

    prompt = np.random.default_rng(0).integers(0, m["model"]["vocab_size"], (m["batch"], m["prompt_len"])).astype(np.int32)
    positions = [runner.positions[m["prompt_len"] + i % (m["max_seq"] - m["prompt_len"])]._buffer_view for i in range(steps)]
    sem = device.create_semaphore(0)
    state = {"value": 0}

    def call(token: Any, i: int, wait: Any) -> tuple[Any, Any]:
        """decode$async(token, pos, wait, signal): returns the token view and the fence it signals."""
        state["value"] += 1
        signal = rt.HalFence.create_at(sem, state["value"])
        args = rt.VmVariantList(4)
        for ref in (token, positions[i], wait, signal):
            args.push_ref(ref)
        rets = rt.VmVariantList(2)
        context.invoke(decode_async, args, rets)
        return rets.get_as_object(0, rt.HalBufferView), signal

    # correctness: the same greedy tokens from the synchronous and the asynchronous calls
    first, _ = runner.prefill(prompt)
    token, sync_tokens = first, []
    for i in range(steps):
        token = sync_call(token, i)
        sync_tokens.append(runner.tokens(token))
    first, _ = runner.prefill(prompt)
    view, async_tokens = first._buffer_view, []
    for i in range(steps):
        view, signal = call(view, i, rt.HalFence(0))
        signal.wait()
        async_tokens.append(runner.tokens(rt.DeviceArray(device, view)))
    same = all(np.array_equal(a, b) for a, b in zip(sync_tokens, async_tokens))

    out: dict[str, Any] = {"module": module.name, "variant": m["variant"], "function": function, "flags": " ".join(flags), "tokens_agree": same,
                           "queue_ops": m.get(f"{function}_queue_ops"), "alloca_bytes": m.get(f"{function}_alloca_bytes")}
    holder = {"token": first}

    def sync_step(i: int) -> None:
        holder["token"] = sync_call(holder["token"], i)

    out["sync_ms"] = _p50(sync_step, steps)
    views = {"view": holder["token"]._buffer_view}

    def async_wait(i: int) -> None:
        views["view"], signal = call(views["view"], i, rt.HalFence(0))
        signal.wait()

    def async_poll(i: int) -> None:
        views["view"], _ = call(views["view"], i, rt.HalFence(0))
        spin_wait(sem, state["value"])

    out["async_wait_ms"] = _p50(async_wait, steps)
    out["async_poll_ms"] = _p50(async_poll, steps)
    invoke = []
    for i in range(steps):
        t0 = time.perf_counter()
        views["view"], signal = call(views["view"], i, rt.HalFence(0))
        invoke.append(1e3 * (time.perf_counter() - t0))
        signal.wait()
    out["invoke_ms"] = statistics.median(invoke)
    enqueue = []
    t_all = time.perf_counter()
    wait = rt.HalFence(0)
    for i in range(steps):
        t0 = time.perf_counter()
        views["view"], wait = call(views["view"], i, wait)
        enqueue.append(1e3 * (time.perf_counter() - t0))
    wait.wait()
    out["enqueue_ms"] = statistics.median(enqueue)
    out["pipelined_ms_per_step"] = 1e3 * (time.perf_counter() - t_all) / steps
    token = rt.DeviceArray(device, views["view"])
    out["read_wait_ms"] = _p50(lambda i: runner.tokens(token), steps)
    buffer = views["view"].get_buffer()
    nbytes = buffer.byte_length()
    target, _ = runner.readback.targets.get(nbytes) or runner.readback._target(nbytes)
    done = device.create_semaphore(0)

    def read_poll(i: int) -> None:
        device.queue_copy(buffer, target, [], [(done, i + 1)])
        spin_wait(done, i + 1)

    out["read_poll_ms"] = _p50(read_poll, steps)
    return out


COLUMNS = ["variant", "function", "flags", "queue_ops", "alloca_bytes", "tokens_agree", "sync_ms", "async_wait_ms", "async_poll_ms", "invoke_ms",
           "enqueue_ms", "pipelined_ms_per_step", "read_wait_ms", "read_poll_ms"]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--module", type=Path, action="append", required=True, help="a module directory of `edge_vs_torch compile` (repeat)")
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--flag", action="append", default=[], help="an IREE runtime flag (repeat)")
    parser.add_argument("--function", action="append", choices=("decode", "decode_token"), default=None,
                        help="the entry point to time (repeat; default both)")
    parser.add_argument("--json", type=Path, default=None)
    parser.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # this process probes the one module
    args = parser.parse_args(argv)
    functions = args.function or ["decode", "decode_token"]
    if args.one:
        print(json.dumps(probe(args.module[0], args.steps, tuple(args.flag), functions[0]), default=str))
        return
    import subprocess

    from src.edge.compile import load_artifacts

    rows = []
    for module in args.module:
        # a process each: one IREE context per process, as the campaign runs them
        compiled = load_artifacts(module).manifest["functions"]
        for function in functions:
            row = {"variant": module.name, "function": function, "flags": " ".join(args.flag)}
            if function not in compiled:
                rows.append({**row, "tokens_agree": f"not in this module (compiled before {function})"})
                continue
            cmd = [sys.executable, "-m", "benchmarks.edge_roundtrip", "--one", "--module", str(module), "--steps", str(args.steps),
                   "--function", function, *(f"--flag={f}" for f in args.flag)]
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
            lines = proc.stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                rows.append({**row, "tokens_agree": f"failed: {(proc.stderr.strip().splitlines() or ['?'])[-1][:200]}"})
            else:
                rows.append(json.loads(lines[-1]))
    table = ["| " + " | ".join(COLUMNS) + " |", "|" + "|".join("---" for _ in COLUMNS) + "|"]
    for r in rows:
        table.append("| " + " | ".join(f"{r[c]:.3f}" if isinstance(r.get(c), float) else str(r.get(c, "")) for c in COLUMNS) + " |")
    print("\n".join(table))
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2, default=str))


if __name__ == "__main__":
    main()
