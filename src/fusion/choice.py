"""`kernels=auto`: fuse exactly the ops a diagnosis of this model marks memory-bound or latency-limited.

The optimizer is chosen the same way where the diagnosis calls AdamW's kernels memory-bound or
latency-limited: optim.impl=triton if it beats torch's fused AdamW on this GPU (never without a
GPU to time it on, and only where optim.impl is left to auto).

The diagnosis is `diagnosis.json` from `task=diagnose` (src/diagnose/task.py), named by
`kernels.diagnosis` (the file, or a run directory holding diagnose/diagnosis.json); left empty,
the newest one under ./outputs and ./multirun whose run config has this same model. The choice
is written into the job's config (`kernels.fused`, `kernels.diagnosis` made absolute) before the
ranks start, so every rank swaps the same modules and MLflow's params record it. The timings and
the rules behind the picks are outputs, not settings: they go to the run folder's
`kernels_auto.json` (AUTO_FILE), which rank 0 completes with what the model swapped, logs, and
stores as an MLflow artifact.
"""
from __future__ import annotations

import functools
import json
import logging
import time
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict

from src.config.compose import ConfigError
from src.fusion.registry import REGISTRY
from src.profiling.diagnosis import fusable_ops

SEARCH_ROOTS = ("outputs", "multirun")
AUTO_FILE = "kernels_auto.json"
"""kernels=auto's record in the run folder: the choice, its timings and reasons, what the model swapped"""
OPTIMIZER = "adamw"
"""the diagnosis's op for AdamW's kernels: not a module swap, optim.impl (src/fusion/measure.py)"""
FUSED_HEAD = "linear_cross_entropy"
"""the fused head + loss: weighed against the loss alone in the run's steps, and the one precision.fp8_head runs in float8"""
log = logging.getLogger("src.run")


@dataclass
class AutoChoice:
    diagnosis: str
    """the diagnosis.json read"""
    device: str
    """the GPU it was measured on"""
    ops: dict[str, list[str]]
    """registry op -> the diagnosis lines that call for it"""
    measured: dict[str, dict[str, float]] = field(default_factory=dict)
    """on a GPU: op -> candidate -> GPU ms per step, forward and backward, the host ahead;
    CANDIDATE.host: the host ms to issue them"""
    reasons: dict[str, str] = field(default_factory=dict)
    """on a GPU: op -> the rule that picked it where GPU time alone would not have"""
    picks: dict[str, str] = field(default_factory=dict)
    """on a GPU: op -> the candidate chosen (eager, compile, triton, ...; the block: picked, compile or eager)"""
    head_trial: str = ""
    """on a GPU: the loss candidate the fused head is weighed against in the run's own steps (head_contest); empty: none"""

    def describe(self) -> str:
        return ", ".join(self.ops) or "nothing (no op is memory-bound or latency-limited)"


def make_one(cfg: DictConfig) -> str:
    return f"python -m src.run +exp=diagnose model={cfg.model.name} backend=cuda"


def _model_of(diagnosis: Path) -> dict | None:
    """The model config of the run that wrote `diagnosis` (RUN/diagnose/diagnosis.json next to RUN/config.yaml)."""
    config = diagnosis.parent.parent / "config.yaml"
    if not config.is_file():
        return None
    return OmegaConf.to_container(OmegaConf.load(config)).get("model")


def find_diagnosis(cfg: DictConfig, cwd: str | Path) -> Path:
    given = cfg.kernels.diagnosis
    if given:
        path = Path(given) if Path(given).is_absolute() else Path(cwd) / given
        if path.is_dir():
            path = next((p for p in (path / "diagnose" / "diagnosis.json", path / "diagnosis.json") if p.is_file()), path)
        if not path.is_file():
            raise ConfigError(f"kernels.diagnosis={given}: no diagnosis.json there; make one on an NVIDIA GPU with Nsight Compute: `{make_one(cfg)}`")
        return path
    want = OmegaConf.to_container(cfg.model, resolve=True)
    found = [p for root in SEARCH_ROOTS for p in (Path(cwd) / root).glob("**/diagnose/diagnosis.json") if _model_of(p) == want]
    if not found:
        raise ConfigError(
            f"kernels=auto reads a diagnosis of model={cfg.model.name}, and none is under ./outputs or ./multirun; "
            f"make one on an NVIDIA GPU with Nsight Compute: `{make_one(cfg)}`, or name one with kernels.diagnosis=PATH"
        )
    return max(found, key=lambda p: p.stat().st_mtime)


def choose(path: Path) -> AutoChoice:
    """The choice a diagnosis calls for. Read once per process while the file is unchanged: with
    kernels=auto, preflight, the job's own validate and apply_auto_choice all ask for it."""
    stat = path.stat()
    return _choose(str(path), stat.st_mtime_ns, stat.st_size)


@functools.cache
def _choose(path_name: str, mtime_ns: int, size: int) -> AutoChoice:
    path = Path(path_name)
    try:
        diagnosis: dict[str, Any] = json.loads(path.read_text())
        found = fusable_ops(diagnosis)
        ops = {op: found[op] for op in (*REGISTRY, OPTIMIZER) if op in found}  # the registry's order, whatever the diagnosis's
    except (ValueError, KeyError, TypeError) as err:
        raise ConfigError(f"kernels.diagnosis={path}: not a diagnosis this version reads ({err}); make a new one with `python -m src.run +exp=diagnose`") from None
    return AutoChoice(str(path), str(diagnosis.get("device", "")), ops)


MEASURED_ONLY = "no diagnosis of this model: every fusable op it has is timed on this GPU"


def auto_choice(cfg: DictConfig, cwd: str | Path) -> AutoChoice | None:
    """The choice `kernels=auto` makes for this config (None for any other kernels setting). Without
    a diagnosis, on a GPU, every op with a fused variant is a candidate and the timing on this GPU
    decides alone (a diagnosis only narrows what is timed); without either, the run is refused."""
    if not cfg.kernels.auto:
        return None
    try:
        return choose(find_diagnosis(cfg, cwd))
    except ConfigError:
        if cfg.kernels.diagnosis or cfg.backend.name != "cuda" or not _gpu_present():
            raise
        return AutoChoice("", "", {op: [MEASURED_ONLY] for op in (*REGISTRY, OPTIMIZER)})


def apply_auto_choice(cfg: DictConfig, cwd: str | Path, measure: bool = True, run_dir: str | Path | None = None) -> AutoChoice | None:
    """Write the choice into the job's config before the ranks start (see the module docstring),
    and return it with its timings and reasons, which also go to `run_dir`'s AUTO_FILE where given.
    On a GPU (and `measure`), the diagnosed ops' candidates are timed first and the fastest of
    eager, torch.compile and the fused kernel is used (src/fusion/measure.py); elsewhere the
    diagnosis alone decides, and the log says so."""
    choice = auto_choice(cfg, cwd)
    if choice is None:
        return None
    if not choice.diagnosis:
        log.info("kernels=auto: no diagnosis of model=%s under ./outputs or ./multirun; every op with a fused variant is timed on "
                 "this GPU instead, and the timing alone decides (a diagnosis narrows what is timed: `%s`)", cfg.model.name, make_one(cfg))
    module_ops = [op for op in choice.ops if op in REGISTRY]
    fused, compiled, measured, compile_blocks, optimizer, reasons, picks = module_ops, [], {}, bool(cfg.kernels.compile), None, {}, {}
    head_trial, trial_pairs = "", cfg.kernels.loss_trial
    if OPTIMIZER in choice.ops:
        from src.fusion.measure import optimizer_swappable

        why_not = optimizer_swappable(cfg)
        if why_not:
            log.info("kernels=auto: the diagnosis calls for AdamW's kernels, and they stay: %s", why_not)
    if measure and (choice.ops or cfg.precision.float8) and cfg.backend.name == "cuda" and _gpu_present():
        from src.fusion.measure import (
            BLOCK,
            HEAD_BAND,
            HEAD_TRIAL_PAIRS,
            chosen,
            graphs_hint,
            head_contest,
            optimizer_chosen,
        )

        timings = _timings(cfg, list(choice.ops))
        fused, compiled, compile_blocks = chosen(timings)
        contender = None if cfg.precision.get("fp8_head") else head_contest(timings)  # float8's head is fused whatever the timing
        from src.fusion.trial import room

        if contender is not None and room(cfg.train.steps, max(trial_pairs, HEAD_TRIAL_PAIRS)):
            head_trial, trial_pairs = contender, max(trial_pairs, HEAD_TRIAL_PAIRS)
            fused = [*fused, FUSED_HEAD]
            log.info("kernels=auto: the fused head + loss (%s) timed within %d%% of cross_entropy as %s, where the step holds the logits "
                     "it never does: the run's own steps decide between them (src/fusion/trial.py)", FUSED_HEAD, round(100 * HEAD_BAND), contender)
        optimizer = optimizer_chosen(timings)
        # GPU ms a step per candidate, and beside it ("CANDIDATE.host") the host ms to issue it
        measured = {t.op: {**{k: v for k, v in t.ms.items() if v is not None},
                           **{f"{k}.host": v for k, v in t.host_ms.items() if v is not None}} for t in timings}
        reasons = {t.op: t.why for t in timings if t.why}
        picks = {t.op: t.pick for t in timings}
        for t in timings:
            log.info("  %s (GPU ms a step, host ahead; host ms%s): %s -> %s", t.op, "; charged the larger" if t.op == "block" else "", ", ".join(
                f"{k} {v:.3f} ({t.host_ms[k]:.2f})" if v is not None and t.host_ms.get(k) is not None else f"{k} {v:.3f}" if v is not None else f"{k} failed"
                for k, v in t.ms.items()), f"{t.pick} ({t.why})" if t.why else t.pick)
        hint = next((graphs_hint(t, cfg) for t in timings if t.op == BLOCK), None)
        if hint:
            log.info(hint)
    else:
        why = "no GPU here" if measure else "under an external launcher each rank would time on its own"
        log.info("kernels=auto: %s to time the candidates on; the diagnosis alone decides: %s%s", why, ", ".join(module_ops) or "nothing",
                 " (AdamW's kernels are swapped only where they are timed)" if OPTIMIZER in choice.ops else "")
    kept = with_float8_head(cfg, fused)
    if kept != fused:
        log.info("kernels=auto: precision.fp8_head=true runs in the fused head and loss (%s): kept beside the choice", FUSED_HEAD)
    fused = kept
    if cfg.speed.cudagraphs and not compile_blocks and not compiled:
        log.info("kernels=auto: speed.cudagraphs=true replays compiled graphs, and auto compiled nothing; the step launches its kernels one by one")
    with open_dict(cfg):
        if optimizer is not None:
            cfg.optim.impl = optimizer
        cfg.kernels.fused = fused
        cfg.kernels.compiled = compiled
        cfg.kernels.compile = compile_blocks
        cfg.kernels.diagnosis = choice.diagnosis
        cfg.kernels.loss_trial = trial_pairs
    choice = replace(choice, measured=measured, reasons=reasons, picks=picks, head_trial=head_trial)  # a copy: choose() caches the diagnosis's
    if run_dir is not None:
        write_choice(choice, None, Path(run_dir) / AUTO_FILE, cfg.kernels)
    return choice


def _timings(cfg: DictConfig, ops: list[str]) -> list:
    """The candidates' timings on this GPU: reused from the cache where this run was timed before on
    this machine (src/fusion/auto_cache.py), else timed now and kept."""
    from src.fusion.auto_cache import AutoCache, CacheRefused
    from src.fusion.measure import OpTiming, measure_on_gpu

    cache = AutoCache.for_run(cfg, ops)
    try:
        cached = cache.lookup() if cache is not None else None
    except CacheRefused as err:
        log.warning("kernels=auto: %s; timing again", err)
        cached = None
    if cached is not None:
        log.info("kernels=auto: reusing the timings measured %s on this GPU, torch and code (%s; delete it to time again)",
                 cached.measured_at, cached.path)
        return [OpTiming(**t) for t in cached.timings]
    changed = cache.differs() if cache is not None else None
    if changed:
        log.info("kernels=auto: timing again: %s", changed)
    log.info("kernels=auto: timing eager, torch.compile and the fused kernel of %s on this GPU, then the block as picked, compiled%s "
             "and eager", ", ".join(ops) or "no diagnosed op", " (replayed from CUDA graphs, speed.cudagraphs)" if cfg.speed.cudagraphs else "")
    start = time.perf_counter()
    timings = measure_on_gpu(ops, cfg)
    kept = f"; kept in {cache.store(timings)}" if cache is not None else " (the GPU has no name NVML gives: not kept)"
    log.info("kernels=auto: timed in %s%s", search_seconds(timings, time.perf_counter() - start), kept)
    return timings


def search_seconds(timings: list, total: float) -> str:
    """Where the search's wall time went: each op's candidates (built, compiled, timed), and the rest
    (the timing process's start: torch, CUDA and the model's config)."""
    parts = [f"{t.op} {t.seconds:.0f}" for t in timings]
    rest = total - sum(t.seconds for t in timings)
    return f"{total:.0f} s ({', '.join([*parts, f'the process {rest:.0f}'])})"


def with_float8_head(cfg: DictConfig, fused: list[str]) -> list[str]:
    """auto's fused ops, with the fused head + loss kept where precision.fp8_head asks for it: the float8
    logits GEMM runs only there, so it is the precision setting's to decide, not the timing of the bf16 head."""
    if not cfg.precision.get("fp8_head") or FUSED_HEAD in fused:
        return list(fused)
    return [*fused, FUSED_HEAD]


def _gpu_present() -> bool:
    import torch

    return torch.cuda.is_available()  # asks the driver without creating a context in this process


def write_choice(choice: AutoChoice, swapped: dict[str, int] | None, path: Path, kernels_cfg: DictConfig | None = None) -> dict:
    """kernels_auto.json: what the diagnosis called for and why, what was timed and chosen (fused,
    compiled; nothing timed without a GPU), and what the model had to swap (0: the op is not a
    module of this model, e.g. swiglu on the seed's plain SiLU MLP; None: not swapped yet)."""
    record = asdict(choice) if swapped is None else {**asdict(choice), "swapped": swapped}
    if kernels_cfg is not None:
        record.update(OmegaConf.to_container(kernels_cfg, resolve=True))
    path.write_text(json.dumps(record, indent=2))
    return record


def read_choice(path: Path) -> AutoChoice | None:
    """The choice write_choice left at `path` (before the ranks started, with its timings); None where there is none."""
    if not path.is_file():
        return None
    record = json.loads(path.read_text())
    return AutoChoice(**{f.name: record[f.name] for f in fields(AutoChoice) if f.name in record})
