"""torchtitan 0.2.2's own trainer beside `+exp=llama3_1b` on LLaMA 3.2 1B's shape, one call, one GPU (issue 54).

    source .whl/activate.sh && python -m benchmarks.torchtitan_llama --steps 30 --budget-s 560 --out bench_out/titan \\
        --titan-settings eager,compile,compile_fp8 \\
        --ours bf16="+exp=llama3_1b model.tie_embeddings=false" --ours fp8="+exp=llama3_1b_fp8 model.tie_embeddings=false"

Runs go in order, torchtitan's first; past --budget-s none starts. `--rounds 2` runs the whole plan twice,
alternated, and gives each of ours against its own round's torchtitan, then the range of those ratios. The defaults (four torchtitan settings,
four of ours) are about two 10-minute calls; the five above, one.

The GPU machine has no network: torchtitan 0.2.2 and what the image lacks of its dependencies (torchdata,
datasets, dill, multiprocess, tyro, docstring-parser, typeguard; tomllib is in Python 3.12's standard
library) are carried as wheels in --wheels and installed into --site, which only the torchtitan runs see
on their PYTHONPATH (after torchao's /tmp/site, for float8). torchtitan's llama3 has no 1B flavor:
benchmarks/torchtitan_flavor.py adds one through its `--experimental.custom_import`. Its tokenizer is a
byte-level BPE without merges (258 ids, the 1B flavor keeps vocab 128256) and its data the standard
library's sources as JSON lines, both written under OUT/assets; our side draws random tokens. The token
values do not change the work of a step.

Each torchtitan setting is one trainer run: batch --batch x --seq-len, --steps steps, metrics each
step, no checkpoint, activation checkpointing off unless the setting says (torchtitan defaults to
selective per-layer; 1B at batch 4 fits the H200 without it). On one GPU torchtitan does not shard and
trains fp32 weights under bf16 autocast (its maybe_enable_amp); ours keeps bf16 compute weights through
FSDP2's mixed precision. torchtitan's llama3 does not tie the head to the embedding, so ours runs
untied (`model.tie_embeddings=false`) beside the tied preset.

Figures are medians over the steps after --warmup. MFU is given twice for torchtitan's runs: its own
log's and this project's formula (benchmarks/torchtitan_flavor.flops_per_token at 989 TFLOP/s, the H200's
dense bf16), which agree for an untied model; ours shows its summary.json's (this project's formula).
Peak memory is the caching allocator's reserved peak in GB (1e9 bytes) on both sides. A run that
fails or passes --timeout-s is a row marked failed with its log's last lines; the others go on.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.fsdp_vs_seed import ENV_VAR, split_named
from benchmarks.torchtitan_flavor import FLAVORS, flops_per_token

ROOT = Path(__file__).resolve().parents[2]
H200_BF16_PEAK = 989e12  # dense bf16 FLOP/s, the peak both torchtitan and src/train/metrics.py use for an H200

# torchtitan settings: the trainer flags each adds to the common ones. compile's default components are
# model and loss; float8 leaves the 2048 x 128256 head in bf16 as torchtitan's own llama3 float8 configs do.
TITAN_SETTINGS: dict[str, list[str]] = {
    "eager": [],
    "compile": ["--compile.enable"],
    "compile_fp8": ["--compile.enable", "--model.converters", "quantize.linear.float8",
                    "--quantize.linear.float8.filter_fqns", "output"],
    "compile_fp8_rowwise": ["--compile.enable", "--model.converters", "quantize.linear.float8",
                            "--quantize.linear.float8.recipe_name", "rowwise",
                            "--quantize.linear.float8.filter_fqns", "output"],
    "compile_ac_sel": ["--compile.enable", "--activation_checkpoint.mode", "selective",
                       "--activation_checkpoint.selective_ac_option", "op"],
}
DEFAULT_TITAN = "eager,compile,compile_fp8,compile_fp8_rowwise"
DEFAULT_OURS = ["bf16=+exp=llama3_1b model.tie_embeddings=false", "fp8=+exp=llama3_1b_fp8 model.tie_embeddings=false",
                "bf16_tied=+exp=llama3_1b", "fp8_tied=+exp=llama3_1b_fp8"]

# MetricsProcessor.log in torchtitan 0.2.2 (components/metrics.py), colours off or stripped:
# "step:  5  loss: 11.95312  grad_norm:  3.1416  memory: 21.07GiB(14.85%)  tps: 45,123  tflops: 370.12  mfu: 37.42%"
STEP_LINE = re.compile(r"step:\s*(?P<step>\d+)\s+loss:\s*(?P<loss>\S+)\s+grad_norm:\s*(?P<grad_norm>\S+)\s+"
                       r"memory:\s*(?P<mem_gib>[\d.]+)GiB\([\d.]+%\)\s+tps:\s*(?P<tps>[\d,]+)\s+"
                       r"tflops:\s*(?P<tflops>[\d,.]+)\s+mfu:\s*(?P<mfu>[\d.]+)%")
SIZE_LINE = re.compile(r"size:\s*([\d,]+) total parameters")
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def parse_titan_log(text: str) -> tuple[list[dict], int | None]:
    """torchtitan's per-step metrics ([{step, loss, grad_norm, mem_gib, tps, tflops, mfu}]) and the
    parameter count it printed, from its log."""
    text = ANSI.sub("", text)
    steps = []
    for m in STEP_LINE.finditer(text):
        d = m.groupdict()
        steps.append({"step": int(d["step"]), "loss": float(d["loss"]), "grad_norm": float(d["grad_norm"]),
                      "mem_gib": float(d["mem_gib"]), "tps": float(d["tps"].replace(",", "")),
                      "tflops": float(d["tflops"].replace(",", "")), "mfu": float(d["mfu"])})
    size = SIZE_LINE.search(text)
    return steps, (int(size.group(1).replace(",", "")) if size else None)


def titan_figures(steps: list[dict], warmup: int, tokens_per_step: int, fpt: float) -> dict:
    """Medians over the steps after `warmup`; the step time from tokens/s (torchtitan logs no step time:
    its tps is the tokens since the last log over the wall time since, here one step)."""
    steady = [s for s in steps if s["step"] > warmup] or steps[-1:]
    tps = statistics.median(s["tps"] for s in steady)
    return {"tokens_per_s_per_device": tps, "mfu_titan": statistics.median(s["mfu"] for s in steady),
            "mfu": 100.0 * fpt * tps / H200_BF16_PEAK, "step_time_s": tokens_per_step / tps,
            "peak_mem_gb": max(s["mem_gib"] for s in steps) * 2**30 / 1e9, "final_loss": steps[-1]["loss"],
            "steps_logged": len(steps)}


def write_assets(assets: Path, corpus_mb: float) -> tuple[Path, Path]:
    """A byte-level tokenizer (vocab.json + empty merges.txt, torchtitan's BPE path) and a JSON-lines
    corpus; returns (tokenizer dir, dataset dir)."""
    from src.data.batches import stdlib_corpus

    tok, data = assets / "tokenizer", assets / "data"
    tok.mkdir(parents=True, exist_ok=True)
    data.mkdir(parents=True, exist_ok=True)
    # GPT-2's byte-to-character table: printable bytes stand for themselves, the other 68 move to 256+
    printable = {*range(33, 127), *range(161, 173), *range(174, 256)}
    chars, extra = {}, 0
    for b in range(256):
        if b in printable:
            chars[b] = chr(b)
        else:
            chars[b], extra = chr(256 + extra), extra + 1
    vocab = {chars[b]: b for b in range(256)}
    (tok / "vocab.json").write_text(json.dumps(vocab))
    (tok / "merges.txt").write_text("#version: 0.2\n")
    # bos and eos become ids 256 and 257 when torchtitan adds them as special tokens
    (tok / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|end_of_text|>", "add_bos_token": True, "add_eos_token": True}))
    text = stdlib_corpus(corpus_mb).decode("utf-8", errors="replace")
    doc = 8192  # characters a document: tokenized per sample on the training process, about 1 ms each
    with open(data / "train.jsonl", "w") as f:
        for i in range(0, len(text), doc):
            f.write(json.dumps({"text": text[i:i + doc]}) + "\n")
    return tok, data


def titan_command(setting: str, args: argparse.Namespace, tok: Path, data: Path) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
            "-m", "torchtitan.train",
            "--experimental.custom_import", "benchmarks.torchtitan_flavor",
            "--model.name", "llama3", "--model.flavor", args.flavor, "--model.hf_assets_path", str(tok),
            "--training.dataset", "c4_test", "--training.dataset_path", str(data),
            "--training.local_batch_size", str(args.batch), "--training.seq_len", str(args.seq_len),
            "--training.steps", str(args.steps),
            "--metrics.log_freq", "1", "--metrics.disable_color_printing",
            "--activation_checkpoint.mode", "none",
            "--job.dump_folder", str(args.out / f"titan-{setting}"),
            *TITAN_SETTINGS[setting], *args.titan_arg]


def titan_env(args: argparse.Namespace) -> dict:
    # the carried site after what is already there (torchao in /tmp/site): torchtitan's own deps come
    # from --site, the image's torch stays first; the repo root for the flavor module
    path = [os.environ.get("PYTHONPATH", ""), str(args.site), str(ROOT)]
    return dict(os.environ, PYTHONPATH=":".join(p for p in path if p), HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                HF_DATASETS_CACHE=str(args.out / "hf_datasets_cache"), LOG_RANK="0")


def ours_command(name: str, overrides: list[str], args: argparse.Namespace) -> tuple[list[str], dict]:
    exp = next((o for o in overrides if o.startswith("+exp=")), "+exp=llama3_1b")
    rest = [o for o in overrides if o != exp and not ENV_VAR.match(o)]
    env = dict(os.environ, **dict(o.split("=", 1) for o in overrides if ENV_VAR.match(o)))
    cmd = [sys.executable, "-m", "src.run", exp, f"dist.nproc={args.nproc}", f"train.steps={args.steps}",
           f"train.untimed_steps={args.warmup}", f"data.batch_size={args.batch}", f"data.seq_len={args.seq_len}",
           "train.progress=false", "tracking=none", f"hydra.run.dir={args.out / f'ours-{name}'}", *rest]
    return cmd, env


def run_logged(cmd: list[str], env: dict, log: Path, timeout: float) -> tuple[int | None, str]:
    """Run `cmd` in its own process group with its output in `log`; past `timeout` the whole group is
    killed (torchrun's workers hold the GPU after torchrun itself dies). (exit code or None, log text)."""
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, env=env, cwd=ROOT, start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            rc = None
    return rc, log.read_text(errors="replace")


def _tail(text: str, n: int = 6) -> str:
    """The first exception line (torchrun's own summary that ends the log repeats the trace less
    readably), then the last `n` lines."""
    lines = [ln for ln in ANSI.sub("", text).strip().splitlines() if ln.strip()]
    first = next((ln for ln in lines if re.search(r"\w(Error|Exception)\b:", ln)), None)
    return "\n".join(([first] if first else []) + lines[-n:])[-1500:]


def run_titan(setting: str, args: argparse.Namespace, tok: Path, data: Path, timeout: float) -> dict:
    rc, text = run_logged(titan_command(setting, args, tok, data), titan_env(args), args.out / f"titan-{setting}.log", timeout)
    steps, size = parse_titan_log(text)
    if rc is None:
        return {"error": f"timed out after {timeout:.0f} s; {len(steps)} steps logged\n{_tail(text)}"}
    if rc or not steps:
        return {"error": f"exit code {rc}, {len(steps)} steps logged\n{_tail(text)}"}
    fpt = flops_per_token(FLAVORS[args.flavor], args.seq_len, tied=False)
    return {**titan_figures(steps, args.warmup, args.batch * args.seq_len, fpt), "params": size}


def run_ours(name: str, overrides: list[str], args: argparse.Namespace, timeout: float) -> dict:
    cmd, env = ours_command(name, overrides, args)
    rc, text = run_logged(cmd, env, args.out / f"ours-{name}.log", timeout)
    summary = args.out / f"ours-{name}" / "summary.json"
    if rc is None:
        return {"error": f"timed out after {timeout:.0f} s\n{_tail(text)}"}
    if rc or not summary.exists():
        return {"error": f"exit code {rc}\n{_tail(text)}"}
    s = json.loads(summary.read_text())
    return {"tokens_per_s_per_device": s.get("tokens_per_s_per_device"), "mfu": s.get("mfu"),
            "step_time_s": s.get("step_time_s"), "peak_mem_gb": s.get("peak_mem_reserved_gb"),
            "final_loss": s.get("final_loss")}


def _fmt(value: float | None, spec: str) -> str:
    return "n/a" if value is None else format(value, spec)


def table(rows: list[dict]) -> str:
    """The rows as a markdown table, each of ours against the best torchtitan setting of its own
    round (rows without a "round" are one round); with two rounds or more, each of ours's range of
    those ratios after the table."""
    rounds = sorted({r.get("round", 1) for r in rows})
    best = {}
    for n in rounds:
        ok_titan = [r for r in rows if r.get("round", 1) == n and r["whose"] == "torchtitan" and "error" not in r]
        best[n] = max(ok_titan, key=lambda r: r["tokens_per_s_per_device"], default=None)
    many = len(rounds) > 1
    out = [f"| {'round | ' if many else ''}run | whose | tok/s/GPU | MFU % (torchtitan's log) | MFU % (our formula) | step ms | peak GB | vs torchtitan best |",
           f"|{'---:|' if many else ''}---|---|---:|---:|---:|---:|---:|---:|"]
    ratios: dict[str, list[float]] = {}
    for r in rows:
        lead = f"| {r.get('round', 1)} " if many else ""
        if "error" in r:
            out.append(f"{lead}| {r['run']} | {r['whose']} | failed: {r['error'].splitlines()[0][:80]} | | | | | |")
            continue
        tps, top = r["tokens_per_s_per_device"], best[r.get("round", 1)]
        ratio = tps / top["tokens_per_s_per_device"] if top and tps else None
        if ratio is not None and r["whose"] == "ours":
            ratios.setdefault(r["run"], []).append(ratio)
        out.append(f"{lead}| {r['run']} | {r['whose']} | {_fmt(tps, ',.0f')} | {_fmt(r.get('mfu_titan'), '.1f')} | "
                   f"{_fmt(r.get('mfu'), '.1f')} | {_fmt(r['step_time_s'] and 1e3 * r['step_time_s'], '.1f')} | "
                   f"{_fmt(r.get('peak_mem_gb'), '.1f')} | {_fmt(ratio, '.3f')}{'x' if ratio is not None else ''} |")
    if many and ratios:
        out.append("\n" + "; ".join(f"{name}: {min(v):.3f}x-{max(v):.3f}x torchtitan's best over {len(v)} rounds"
                                      for name, v in ratios.items()))
    named = {b["run"] for b in best.values() if b}
    if named:
        out.append(f"\ntorchtitan's best setting: {', '.join(sorted(named))}. torchtitan's llama3 does not tie the head to the embedding: "
                   "compare it with ours untied (bf16, fp8); the tied rows are the preset as it ships. MFU (our formula) "
                   "is 6 x matmul parameters + 12 x layers x heads x head_dim x seq per token at 989 TFLOP/s.")
    return "\n".join(out)


def parse_ours(text: str) -> tuple[str, list[str]]:
    name, overrides = split_named(text)
    if not overrides or not name:
        raise argparse.ArgumentTypeError(f"--ours {text!r}: give NAME=OVERRIDES, e.g. bf16=\"+exp=llama3_1b model.tie_embeddings=false\"")
    return name, overrides


def main(argv: list[str] | None = None, clock=time.monotonic) -> list[dict]:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--titan-settings", default=DEFAULT_TITAN,
                    help=f"comma-separated, from {', '.join(TITAN_SETTINGS)}; empty for none")
    ap.add_argument("--ours", type=parse_ours, action="append", default=None,
                    help="NAME=OVERRIDES for python -m src.run, repeatable (default: bf16, fp8 untied; bf16_tied, fp8_tied)")
    ap.add_argument("--no-ours", action="store_true", help="torchtitan's runs only")
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--warmup", type=int, default=5, help="steps left out of the medians (compilation, allocator warm-up)")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--nproc", type=int, default=1)
    ap.add_argument("--flavor", default="1B", choices=list(FLAVORS), help="1B_smoke: a tiny shape for a CPU check of torchtitan's side")
    ap.add_argument("--titan-arg", action="append", default=[], help="one more torchtitan flag or value for every torchtitan run, repeatable")
    ap.add_argument("--wheels", type=Path, default=ROOT / ".whl" / "titan", help="torchtitan 0.2.2 and its missing dependencies as wheels")
    ap.add_argument("--site", type=Path, default=Path("/tmp/titan_site"), help="where the wheels are installed (torchtitan runs only)")
    ap.add_argument("--no-install", action="store_true", help="--site is installed already")
    ap.add_argument("--corpus-mb", type=float, default=2.0, help="JSON-lines text for torchtitan's loader; it loops over it")
    ap.add_argument("--timeout-s", type=float, default=150.0, help="each run's own limit")
    ap.add_argument("--rounds", type=int, default=1, help="the whole plan this many times, alternated (each of ours against its own round's torchtitan)")
    ap.add_argument("--budget-s", type=float, default=float("inf"), help="start no run past this many seconds of wall time")
    ap.add_argument("--out", type=Path, default=Path("bench_out/torchtitan"))
    ap.add_argument("--dry-run", action="store_true", help="write the assets, print the commands, run nothing")
    args = ap.parse_args(argv)
    args.out = args.out.resolve()
    args.out.mkdir(parents=True, exist_ok=True)
    settings = [s for s in args.titan_settings.split(",") if s]
    unknown = [s for s in settings if s not in TITAN_SETTINGS]
    if unknown:
        ap.error(f"--titan-settings: unknown {unknown}; choose from {list(TITAN_SETTINGS)}")
    ours = [] if args.no_ours else (args.ours or [parse_ours(t) for t in DEFAULT_OURS])
    if len({n for n, _ in ours}) != len(ours):
        ap.error("--ours names must differ")

    t0 = clock()
    wheels = sorted(args.wheels.glob("*.whl"))
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile", "--upgrade",
               "--target", str(args.site), *map(str, wheels)]
    tok, data = write_assets(args.out / "assets", args.corpus_mb)
    if args.rounds < 1:
        ap.error(f"--rounds {args.rounds}: give 1 or more")
    plan = [(whose, name, n) for n in range(1, args.rounds + 1) for whose, name in
            [("torchtitan", s) for s in settings] + [("ours", o) for o, _ in ours]]
    if args.dry_run:
        print(shlex.join(install))
        for whose, name, _ in plan:
            cmd, env = (titan_command(name, args, tok, data), titan_env(args)) if whose == "torchtitan" else ours_command(name, dict(ours)[name], args)
            extra = {k: v for k, v in env.items() if os.environ.get(k) != v}
            print(f"# {whose} {name}\n" + " ".join(f"{k}={shlex.quote(v)}" for k, v in extra.items()) + " " + shlex.join(cmd))
        return []
    if settings and not args.no_install:
        if not wheels:
            ap.error(f"--wheels {args.wheels}: no wheels there (see benchmarks/torchtitan_llama.py's docstring for the list)")
        subprocess.run(install, check=True)
        print(f"installed {len(wheels)} wheels into {args.site} ({clock() - t0:.0f} s)", flush=True)

    rows: list[dict] = []
    longest = 0.0
    for whose, name, n in plan:
        elapsed = clock() - t0
        if elapsed + min(longest, args.timeout_s) > args.budget_s:
            print(f"--budget-s {args.budget_s:g}: no new run after {elapsed:.0f} s; left out: "
                  f"{', '.join(f'{p} (round {k})' for _, p, k in plan[len(rows):])}", flush=True)
            break
        timeout = min(args.timeout_s, max(args.budget_s - elapsed, 1.0))
        start = clock()
        figures = run_titan(name, args, tok, data, timeout) if whose == "torchtitan" else run_ours(name, dict(ours)[name], args, timeout)
        took = clock() - start
        longest = max(longest, took)
        rows.append({"run": name, "whose": whose, "round": n, "wall_s": took, **figures})
        (args.out / "rows.json").write_text(json.dumps(rows, indent=2))  # after every run: a cut-off call keeps what ran
        what = figures.get("error") or (f"{figures['tokens_per_s_per_device']:,.0f} tok/s/GPU, MFU {_fmt(figures.get('mfu'), '.1f')}%"
                                        f" (torchtitan's {_fmt(figures.get('mfu_titan'), '.1f')}%), step {1e3 * figures['step_time_s']:.1f} ms")
        print(f"{whose:<10} {name:<20} {f'round {n} ' if args.rounds > 1 else ''}({took:.0f} s): {what}", flush=True)
    print()
    text = table(rows)
    print(text)
    (args.out / "table.md").write_text(text + "\n")
    return rows


if __name__ == "__main__":
    main()
