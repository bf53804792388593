"""task=infer (`+exp=edge`): one model on one edge backend, prefill + decode, against torch fp32 on
the CPU; or `edge.action=compile` to write artifacts for another device, `edge.action=run` to time
artifacts compiled elsewhere. Writes summary.json, edge_latency.png, the artifacts (vulkan), and
one MLflow run (a child of the sweep's parent in a multirun)."""
from __future__ import annotations

import copy
import logging
import textwrap
from pathlib import Path
from typing import Any

import numpy as np
import torch
from omegaconf import DictConfig, OmegaConf

from src.distributed.launch import RankFailed
from src.dtypes import torch_dtype
from src.edge.bench import measure, tolerance_error
from src.edge.compile import NO_GROWING_HOISTS, Artifacts, build, cache_root, load_artifacts
from src.edge.matvec import takes_weights_first, use_matvec
from src.edge.model import EdgeLM
from src.edge.quant import fuse_dequantization, quantized_copy, weight_bytes
from src.edge.tiles import default_prefill_flags
from src.runtime import RunContext

log = logging.getLogger("src.run")

IREE_DEVICE = {"vulkan": "vulkan", "mps": "metal"}
CORPUS_MB = 4.0
"""data.corpus_mb's default: the training text a held-out perplexity starts after"""


class EdgeRunFailed(RankFailed):
    """A run that ended with a reason already said in one line (module refused by the driver, wrong
    numbers, a target that does not match the device): task_wrapper logs a RankFailed without a
    traceback, run_job exits 1, and the figures and the MLflow run were recorded FAILED before raising."""


def load_hint(manifest: dict) -> str:
    """What to try when the driver refuses a module."""
    if manifest.get("cooperative_matrix"):
        return ("the variant without cooperative matrices: edge.target=pascal for NVIDIA (the same code without "
                "VK_KHR_cooperative_matrix), or variant nocoop in `python -m benchmarks.edge_vs_torch`")
    if manifest.get("dtype") != "fp32":
        return "edge.dtype=fp32, or a driver that computes in " + manifest.get("dtype", "this dtype")
    return "edge.target matching the device, and the driver's own `vulkaninfo` for what it supports"


def default_target(backend: str, target: str) -> str:
    return target or {"vulkan": "llvmpipe", "mps": "macos"}.get(backend, "")


def reference_model(model_cfg: dict, weights: dict, max_seq: int, batch: int = 1) -> EdgeLM:
    """The model in fp32 on the CPU: seeded initialisation (src/distributed/parallelize.py, as
    training starts from), a safetensors export of a trained one, or a Hugging Face folder's weights."""
    from src.distributed.parallelize import materialize_and_init
    from src.models import meta_model

    model = meta_model(model_cfg)
    materialize_and_init(model, torch.device("cpu"), weights.get("seed", 0))
    if weights.get("safetensors"):
        from safetensors.torch import load_file

        model.load_state_dict(load_file(weights["safetensors"]))
    elif weights.get("hf_path"):
        from src.models import architecture

        architecture(model_cfg["arch"]).hf.load(model, Path(weights["hf_path"]))
    return EdgeLM(model.eval(), max_seq, batch).eval()


def quant_setting(fmt: str, group_size: int, fused: bool = True) -> dict:
    """edge.quant as a manifest records it (src/edge/quant.py quant_spec): {"format"}, with "fused"
    for int8 and int4 and "group_size" for int4."""
    if fmt == "none":
        return {"format": fmt}
    return {"format": fmt, "fused": fused, "group_size": group_size} if fmt == "int4" else {"format": fmt, "fused": fused}


def dequantization(manifest: dict) -> str | None:
    """Where a quantized module's decode dequantizes its weights (src/edge/quant.py): in each call
    (inside the matvecs, or in a dispatch of its own before the matmul), or once at load, where
    IREE's default hoisting (the fp16 fallback, src/edge/compile.py) made the dequantized weights
    constants of the initializer: a smaller archive, the dtype's weights resident."""
    quant = manifest.get("quant") or {}
    if quant.get("format", "none") == "none":
        return None
    if not (manifest.get("hoisting") == "no growing hoists" or NO_GROWING_HOISTS in manifest.get("flags", [])):
        return "at load"
    # decode's products are matvecs at batch 1, and at 2-8 sequences with edge.matvec_rows covering them
    batch = manifest.get("batch", 1)
    matvecs = batch == 1 or takes_weights_first(batch, manifest.get("matvec_rows", 0))
    return "per call, fused into the matvecs" if quant.get("fused") and matvecs else "per call, a dispatch of its own"


def deployed(reference: EdgeLM, settings: dict) -> EdgeLM:
    """The model as the module holds it: quantized as settings["quant"] says (from fp32), then in
    settings["dtype"]; a copy, the reference stays fp32 and unquantized."""
    return copy.deepcopy(quantized_copy(reference, settings.get("quant") or {"format": "none"})).to(torch_dtype(settings["dtype"]))


def _weights(cfg: DictConfig) -> dict:
    """Where the parameters come from: an export (edge.weights), a Hugging Face folder (model.hf_path),
    else the seeded initialisation."""
    if cfg.edge.weights:
        return {"safetensors": str(Path(cfg.edge.weights).resolve())}
    if OmegaConf.select(cfg, "model.hf_path", default=""):
        return {"hf_path": str(Path(cfg.model.hf_path).resolve())}
    return {"seed": cfg.edge.seed}


def latency_chart(summary: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = ["TTFT p50", "TTFT p90", "decode p50", "decode p90"]
    values = [summary.get(k) or 0.0 for k in ("ttft_p50_ms", "ttft_p90_ms", "decode_p50_ms", "decode_p90_ms")]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.bar(labels, values, color=["tab:blue", "tab:blue", "tab:orange", "tab:orange"])
    ax.set_ylabel("ms")
    # a Vulkan device's name runs long ("llvmpipe (LLVM 15.0.6, 256 bits)"): wrapped, never cut at the figure's edge
    title = f"{summary['backend']} ({summary['device_name']}), batch {summary['batch']}, {_format(summary)}"
    ax.set_title(textwrap.fill(title, 60), fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _format(summary: dict[str, Any]) -> str:
    """The dtype, and the weights' quantization where there is one: "fp16 int8"."""
    quant = summary.get("quant") or "none"
    return summary["dtype"] if quant == "none" else f"{summary['dtype']} {quant}"


def table(summary: dict[str, Any]) -> str:
    def f(key: str, digits: int = 2) -> str:
        value = summary.get(key)
        return "n/a" if value is None else f"{value:,.{digits}f}" if isinstance(value, float) else str(value)

    head = ("| backend | device | variant | batch | dtype | compile s | first ms | TTFT p50/p90 ms | decode p50/p90 ms | prefill tok/s | "
            "decode tok/s | rel err | same tokens | perplexity (fp32) | status |")
    row = (f"| {summary['backend']} | {summary['device_name']} | {summary.get('variant') or '-'} | {summary['batch']} | {_format(summary)} | "
           f"{f('compile_s')} | {f('first_run_ms')} | {f('ttft_p50_ms')} / {f('ttft_p90_ms')} | {f('decode_p50_ms', 3)} / {f('decode_p90_ms', 3)} | "
           f"{f('prefill_tokens_per_s', 0)} | {f('decode_tokens_per_s', 0)} | {summary['rel_err']:.2e} | {f('same_tokens_steps')}/{summary['decode_steps'] + 1} | "
           f"{f('perplexity', 3)} ({f('perplexity_fp32', 3)}) | {summary['status']} |")
    return "\n".join([head, "|---|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|", row])


def run_infer(cfg: DictConfig, ctx: RunContext) -> dict[str, Any]:
    """task=infer in this process; src/tasks.py's one_shot has written config.yaml and opened run.log."""
    from src.tracking.mlflow_run import task_tracker, write_json

    run_dir = Path(ctx.run_dir)
    e, backend = cfg.edge, cfg.backend.name
    target = default_target(backend, e.target)
    model_cfg = OmegaConf.to_container(cfg.model, resolve=True)
    settings = {"batch": e.batch, "prompt_len": e.prompt_len, "decode_steps": e.decode_steps, "dtype": e.dtype,
                "max_seq": e.max_seq or e.prompt_len + e.decode_steps, "weights": _weights(cfg), "model": model_cfg,
                "quant": quant_setting(str(e.quant), e.quant_group, fuse_dequantization(IREE_DEVICE.get(backend, backend), target)),
                "held_out_after_mb": cfg.data.corpus_mb}  # the perplexity's text: after what training on data=text reads
    artifacts: Artifacts | None = None
    if e.action == "run":
        artifacts = load_artifacts(Path(e.artifacts))
        m = artifacts.manifest
        settings.update(batch=m["batch"], prompt_len=m["prompt_len"], max_seq=m["max_seq"], dtype=m["dtype"], weights=m["weights"], model=m["model"],
                        quant=m.get("quant") or {"format": "none"})
        target = m["target"]
    reference = reference_model(settings["model"], settings["weights"], settings["max_seq"], settings["batch"])
    summary: dict[str, Any] = {"task": "infer", "status": "finished", "action": e.action, "backend": backend, "target": target or None,
                               "device_name": "cpu", "cooperative_matrix": None, "compile_s": None, "module_bytes": None, "params_bytes": None,
                               **{k: settings[k] for k in ("batch", "prompt_len", "decode_steps", "dtype", "max_seq")}, "model": settings["model"]["name"],
                               "quant": settings["quant"]["format"], "quant_group": settings["quant"].get("group_size"),
                               "settings": {"model": settings["model"]["name"], "backend": backend}, "quality_tolerance": e.quality_tolerance}
    held = deployed(reference, settings)  # the weights as the module holds them (and torch, off IREE)
    summary.update(weight_bytes(held))
    if backend in IREE_DEVICE and e.action in ("bench", "compile"):
        out = Path(e.artifacts) if (e.action == "compile" and e.artifacts) else run_dir / "artifacts"
        batch, cache = settings["batch"], cache_root(e.cache_dir)
        flags = default_prefill_flags(cache / "tiles", target, settings["dtype"], batch * settings["prompt_len"], settings["model"]["n_heads"], batch)
        artifacts = build(use_matvec(held, e.matvec_rows if batch > 1 else 0), settings["model"], settings["prompt_len"],  # one row is a matvec already
                          settings["dtype"], IREE_DEVICE[backend], target, e.target_features, out, cache, settings["weights"], extra_flags=flags)
    if artifacts is not None:
        m = artifacts.manifest
        if not artifacts.irpa.is_file():  # compiled elsewhere without parameters: the seeded or exported weights, written here
            from src.edge.params import write_params

            write_params(held, artifacts.irpa)
        summary.update(compile_s=m["compile_s"], module_bytes=m["module_bytes"], params_bytes=artifacts.irpa.stat().st_size,
                       artifacts=str(artifacts.dir), cache=m["cache"], msl_files=len(m.get("msl_files", [])), variant=m.get("variant"),
                       module_cooperative_matrix=m.get("cooperative_matrix"), flags=" ".join(m["flags"]), hoisting=m.get("hoisting"),
                       matvec_rows=m.get("matvec_rows", 0),
                       dequantization=dequantization(m))
    try:
        if e.action == "compile":
            log.info("compiled for %s %s (%s): %s (module %d bytes, parameters %d bytes)", IREE_DEVICE[backend], target, summary["variant"],
                     artifacts.dir, summary["module_bytes"], summary["params_bytes"])
        else:
            _run(backend, artifacts, reference, settings, e, summary)
            log.info("edge inference:\n%s", table(summary))
            latency_chart(summary, run_dir / "edge_latency.png")
    except EdgeRunFailed as err:
        summary.update(status="failed", error=str(err))
    tracker = task_tracker(cfg, ctx, summary["device_name"])
    summary["mlflow_run_id"] = tracker.run_id
    write_json(run_dir / "summary.json", summary)
    for name in ("summary.json", "config.yaml", "run.log", "edge_latency.png"):
        tracker.log_artifact(run_dir / name)
    if artifacts is not None:
        tracker.log_artifact(artifacts.dir / "manifest.json", "edge")
        if (artifacts.dir / "msl").is_dir():
            tracker.log_artifact(artifacts.dir / "msl", "edge/msl")
    if summary["status"] == "failed":
        write_json(run_dir / "edge_summary.json", summary)  # task_wrapper's failure record replaces summary.json with the error alone
        tracker.set_tags({"variant": str(summary.get("variant")), "status": "failed"})
        tracker.finish("FAILED", _metrics(summary), error=summary["error"])
        raise EdgeRunFailed(summary["error"])
    tracker.finish("FINISHED", _metrics(summary))
    return summary


def _metrics(summary: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in summary.items() if k not in ("batch", "prompt_len", "decode_steps", "max_seq")}


def _run(backend: str, artifacts: Artifacts | None, reference: EdgeLM, settings: dict, e: DictConfig, summary: dict[str, Any]) -> None:
    """Time and check the model on `backend`; raises EdgeRunFailed with the one line that ends the run."""
    from src.edge.runtime import (
        LAVAPIPE,
        IreeRunner,
        ModuleLoadFailed,
        TorchRunner,
        lavapipe_retry,
        one_line,
        vulkan_devices,
    )

    dtype = settings["dtype"]
    rng = np.random.default_rng(e.seed)
    tokens = rng.integers(0, settings["model"]["vocab_size"], (settings["batch"], settings["prompt_len"]), dtype=np.int64).astype(np.int32)
    quant = settings.get("quant") or {"format": "none"}
    quantized = quantized_copy(reference, quant) if quant["format"] != "none" else None

    def measured(runner: Any) -> dict[str, Any]:
        from src.edge.quality import quality

        figures = measure(runner, reference, tokens, e.decode_steps, e.warmup, e.repeats, quantized)
        # the text after what training on data=text read (its default corpus where the caller names none: the lab's benches)
        return {**figures, **quality(runner, reference, quantized, tokens.shape[0], tokens.shape[1], e.decode_steps,
                                     settings["model"]["vocab_size"], settings.get("held_out_after_mb", CORPUS_MB))}

    if backend == "vulkan":
        devices = vulkan_devices()
        summary["device_name"] = devices[0]["name"] if devices else "vulkan"
        summary["cooperative_matrix"] = devices[0]["cooperative_matrix"] if devices else None
        summary.update(check_device(artifacts.manifest, summary["device_name"]))
        cache_bytes = 2 * reference.k_cache.numel() * torch_dtype(dtype).itemsize  # keys and values

        def make_runner(fresh_device: bool) -> Any:
            # counted as each try starts, so a run whose last try failed says how many it took too
            summary["device_tries"] = summary.get("device_tries", 0) + 1
            return IreeRunner(artifacts, "vulkan", flags=tuple(e.runtime_flags), host_wait=str(e.host_wait), token_out=str(e.token_out),
                              fresh_device=fresh_device)

        def transfers_and_figures(runner: Any) -> tuple[Any, dict[str, Any]]:
            return runner, {**runner.transfer_times(cache_bytes), **measured(runner)}

        try:
            # the run's own device (the first IREE lists, whose name the summary reports) decides, not any lavapipe installed beside it
            runner, figures = lavapipe_retry(make_runner, transfers_and_figures, LAVAPIPE in summary["device_name"])
        except ModuleLoadFailed as err:
            raise EdgeRunFailed(load_failure(artifacts.manifest, summary["device_name"], str(err))) from None
        except RuntimeError as err:  # the driver took the module but failed a dispatch or a transfer
            raise EdgeRunFailed(load_failure(artifacts.manifest, summary["device_name"], one_line(err))) from None
        summary.update(figures)
    else:  # quantized the same way: the weights dequantized in torch's forward, before each matmul
        runner = TorchRunner(deployed(reference, settings), {"cpu": "cpu", "cuda": "cuda", "mps": "mps"}[backend], dtype, settings["batch"],
                             compiled=bool(getattr(e, "torch_compile", False)))
        summary["device_name"] = torch.cuda.get_device_name(0) if backend == "cuda" else backend
        summary.update(measured(runner))
    summary["readback"] = getattr(getattr(runner, "readback", None), "mode", None)
    if hasattr(runner, "poll"):
        summary["host_wait"] = "poll" if runner.poll else "block"
        summary["token_out"] = "caller" if runner.token_buffers is not None else "result"
    wrong = tolerance_error(summary)
    if wrong:
        log.info("edge inference:\n%s", table({**summary, "status": "failed"}))
        raise EdgeRunFailed(wrong)


def check_device(manifest: dict, device_name: str) -> dict[str, Any]:
    """Refuse artifacts compiled for another kind of GPU than this one (see targets.target_mismatch)."""
    from src.edge.targets import target_mismatch

    why = target_mismatch(manifest["target"], device_name)
    if why:
        raise EdgeRunFailed(why)
    return {"target_matches_device": True}


def load_failure(manifest: dict, device_name: str, error: str) -> str:
    return (f"target {manifest['target']} {manifest['dtype']} module ({manifest.get('variant')}) failed on {device_name}: {error}; "
            f"try {load_hint(manifest)}")
