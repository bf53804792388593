"""`python -m src.run [OVERRIDES]`: compose -> validate -> dispatch on cfg.task.

Before Hydra creates a run directory, every job of the command (each combination of a -m sweep) is
composed and validated, so a typo or an impossible setting prints one line, exits 2 and leaves
nothing behind: no output directory, no rank, no MLflow run. Under torchrun or a SLURM step the
same entry is a worker: it composes the config itself and rank 0 alone writes the run directory.
"""
from __future__ import annotations

import sys

# Hydra flags that print or inspect instead of running a job: no preflight for these.
_INSPECT_FLAGS = ("--help", "-h", "--hydra-help", "--cfg", "-c", "--info", "-i", "--shell-completion", "-sc", "--version", "--resolve", "-p", "--package")
if __name__ == "__main__" and not any(a.split("=")[0] in _INSPECT_FLAGS for a in sys.argv[1:]):
    # Importing torch, Hydra and MLflow takes 3 s on a quiet 2-core machine and over 10 s on a busy
    # one: say at once that the command started, before any of it.
    print("perflab: composing and checking the config, then starting the run ...", flush=True)

import argparse  # noqa: E402
import itertools  # noqa: E402
import logging  # noqa: E402
import os  # noqa: E402
import re  # noqa: E402
import signal  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from pathlib import Path  # noqa: E402

import hydra  # noqa: E402
from hydra.core.hydra_config import HydraConfig  # noqa: E402
from omegaconf import DictConfig, OmegaConf, open_dict  # noqa: E402

# Only modules that import no torch at module level here: `--help` and `--cfg job` run none of the
# tasks' code, and importing torch for them took most of their time. The rest is imported where used.
from src.config.compose import ConfigError, compose_config, finish  # noqa: E402
from src.distributed.cluster import SUBMITIT_LAUNCHERS, adopt_torchrun_shape, check_launcher, stable_run_dir  # noqa: E402
from src.runtime import RunContext  # noqa: E402
from src.tracking.mlflow_run import PARENT_RUN_ID_FILE, SWEEP_KEYS_FILE, resolve_tracking_uri, shown_uri, store_refusal  # noqa: E402

log = logging.getLogger("src.run")

EXIT_BAD_CONFIG = 2
EXIT_INTERRUPTED = 130  # 128 + SIGINT, what a shell reports for a Ctrl-C'd command


def _job_overrides(overrides: list[str], multirun: bool, config_dir: str | None = None) -> list[list[str]]:
    """Each job's overrides: one job, or every combination of a basic -m sweep, or the corners of
    a searching sweeper's space (hydra/sweeper=optuna: src/tracking/search.py)."""
    from src.tracking.search import search_jobs

    searched = search_jobs(overrides, multirun, config_dir)
    if searched is not None:
        return searched
    user = [o for o in overrides if not o.lstrip("+~").startswith("hydra")]
    if not multirun:
        return [user]
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    from src.config.compose import explain_parse_error

    try:
        parsed = OverridesParser.create().parse_overrides(user)
    except OverrideParseException as err:
        raise ConfigError(explain_parse_error(err, user)) from None
    # Hydra's basic sweeper expands the same way (BasicSweeper.split_arguments, in hydra._internal):
    # a later override of a key replaces an earlier one, and the jobs are the product of the lists.
    values: dict[str, list[str]] = {}
    try:
        for override in parsed:
            key = override.get_key_element()
            if not override.is_sweep_override():
                values[key] = [f"{key}={override.get_value_element_as_str()}"]
            elif override.is_discrete_sweep():
                values[key] = [f"{key}={value}" for value in override.sweep_string_iterator()]
            else:
                return []
    except Exception:  # a sweeper-specific syntax (ranges for Optuna, ...): its own sweeper checks it
        return []
    return [list(job) for job in itertools.product(*values.values())]


def _hydra_settings(overrides: list[str], config_dir: str | None = None) -> DictConfig:
    """The config with Hydra's own node, composed from the command's `hydra...` overrides alone."""
    return compose_config([o for o in overrides if o.lstrip("+~").startswith("hydra")], with_hydra=True, config_dir=config_dir)


def _planned_run_dir(hydra_cfg: DictConfig) -> Path:
    """hydra.run.dir as Hydra will make it, absolute (a `${now:}` in it may tick a second on: such a
    folder is new either way, with no checkpoint in it); `hydra_cfg`: _hydra_settings'."""
    folder = Path(str(OmegaConf.select(hydra_cfg, "hydra.run.dir")))
    return folder if folder.is_absolute() else Path.cwd() / folder


def _check_output_dir(overrides: list[str], multirun: bool, hydra_cfg: DictConfig) -> None:
    """The run (or sweep) directory Hydra is about to create must be a folder of its own, and
    creatable: otherwise Hydra fails with two chained tracebacks (`hydra.run.dir=/proc/x`), or an
    empty `hydra.run.dir=` writes config.yaml, summary.json, run.log and .hydra/ into this folder."""
    import tempfile

    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    value = str(OmegaConf.select(hydra_cfg, key) or "")
    folder = Path(value)
    given = _override_for_key(key, overrides)
    existing = folder if folder.is_absolute() else Path.cwd() / folder
    if not value.strip() or existing.resolve() == Path.cwd().resolve():
        files = "the sweep's files (multirun.yaml, a folder per job: 0/, 1/, ...)" if multirun else "the run's files (config.yaml, summary.json, run.log, .hydra/)"
        what = "an empty folder puts" if not value.strip() else "naming the current folder puts"
        example = "multirun/mine" if multirun else "outputs/mine"
        raise ConfigError(f"{given}: {what} {files} straight into {Path.cwd()}; give them a folder of their own, e.g. {key}={example}")
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if not existing.is_dir():
        raise ConfigError(f"{given}: {existing} is a file, not a folder; choose another {key}")
    try:  # a real probe: permission bits say nothing of /proc, read-only mounts or root's rights
        Path(tempfile.mkdtemp(prefix=".perflab_probe_", dir=existing)).rmdir()
    except OSError as err:
        raise ConfigError(f"{given}: cannot create the run's folder under {existing} ({err.strerror}); choose a writable {key}, e.g. {key}=outputs/mine") from None


def _override_for_key(key: str, overrides: list[str]) -> str:
    return next((o for o in overrides if o.lstrip("+~").split("=", 1)[0] == key), f"{key} (the default)")


def _launcher(overrides: list[str]) -> str:
    """The hydra/launcher option the command picks (basic: Hydra's own, one job at a time)."""
    for o in overrides:
        key, _, value = o.replace(" ", "").lstrip("+").partition("=")
        if key == "hydra/launcher":
            return value
    return "basic"


@dataclass(frozen=True)
class RunFolder:
    """Where the command's run (or sweep) goes: the Hydra setting that names it and the folder, a
    stopped run's that the command continues, or a new one (`new`: main claims it, claim_folder)."""

    key: str
    path: Path
    new: bool


def preflight(overrides: list[str], multirun: bool, config_dir: str | None = None) -> RunFolder | None:
    """Compose and validate every job of the command; raise ConfigError on the first that cannot
    run. `config_dir`: Hydra's --config-dir, searched as Hydra itself will. Returns where the run
    goes; None where the command names its folder itself. Writes nothing."""
    from src.config.validate import validate
    from src.train.resume_check import check_checkpoints

    launcher = _launcher(overrides) if multirun else "basic"
    jobs = []
    for job in _job_overrides(overrides, multirun, config_dir):
        cfg = compose_config(job, config_dir=config_dir)
        # the GPUs are the cluster's, not this (login) machine's: gpus_per_node asks for dist.nproc
        validate(cfg, cuda_device_count=cfg.dist.nproc if launcher == "submitit_slurm" else None)
        if cfg.dist.nnodes > 1 and not cfg.dist.rdzv_endpoint and launcher not in SUBMITIT_LAUNCHERS and not cfg.dist.fake:
            raise ConfigError(
                f"dist.nnodes={cfg.dist.nnodes} needs dist.rdzv_endpoint=HOST:PORT, the first node's address, the same on every node; "
                "or submit with -m hydra/launcher=submitit_slurm, which finds it, or use torchrun --nnodes (docs/CLUSTER.md)"
            )
        jobs.append(cfg)
    check_launcher(launcher, overrides, jobs, config_dir)
    _check_tracking_stores(jobs)
    hydra_cfg = _hydra_settings(overrides, config_dir)  # composed once for both (0.4 s each on a 2-core machine)
    _check_output_dir(overrides, multirun, hydra_cfg)
    # the checkpoint each job resumes from (its files, its model) and the folder it saves in; a
    # sweep's jobs get their folders when they start, so only an explicit one is checked here
    run_dir = None if multirun else _planned_run_dir(hydra_cfg)
    continued = None if multirun else _continues(overrides, jobs[0])
    if continued is not None:
        run_dir = continued
    for cfg in jobs:
        check_checkpoints(cfg, run_dir)
    if launcher != "submitit_slurm":  # the jobs' ranks run on this machine
        _warn_ranks_over_cores(jobs)
    if continued is not None:
        return RunFolder("hydra.run.dir", continued, new=False)
    key = "hydra.sweep.dir" if multirun else "hydra.run.dir"
    if any(o.lstrip("+~").split("=", 1)[0] == key for o in overrides):
        return None  # a folder the user named: theirs to share or not
    planned = Path(str(OmegaConf.select(hydra_cfg, key)))
    return RunFolder(key, planned if planned.is_absolute() else Path.cwd() / planned, new=True)


# where a run goes without hydra.run.dir (conf/config.yaml): the folders a command's stopped run is looked for in
DEFAULT_RUNS_ROOT = "outputs"


def claim_folder(folder: Path) -> Path:
    """`folder`, else `folder-2`, `-3`, ...: the first that this process makes itself (mkdir either
    makes a folder or fails, never both for two processes), so two commands started in the same
    second (the default folders name the second) never share one."""
    folder.parent.mkdir(parents=True, exist_ok=True)
    for n in itertools.count(1):
        candidate = folder if n == 1 else folder.with_name(f"{folder.name}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise AssertionError("unreachable")


def _continues(overrides: list[str], cfg: DictConfig) -> Path | None:
    """A training command with the default folders (no hydra.run.dir, no checkpoint.folder) and
    checkpoint.resume=auto goes on in the folder of its own last run where that run stopped on a
    signal and saved: the same checkpoint, the same MLflow run (src/train/records.py), the same
    metrics.jsonl. Its newest run finished or failed: a new folder."""
    from src.train.resume_check import stopped_run

    if (cfg.task.name not in ("train", "profile") or str(cfg.checkpoint.resume) != "auto" or cfg.checkpoint.folder
            or any(o.lstrip("+~").split("=", 1)[0] == "hydra.run.dir" for o in overrides)):
        return None
    found = stopped_run(Path.cwd() / DEFAULT_RUNS_ROOT, overrides)
    if found is None:
        return None
    folder, summary = found
    print(f"perflab: continuing {folder.relative_to(Path.cwd())}: stopped by {summary.get('preempted_by')} at step "
          f"{summary.get('preempted_at_step')} of {cfg.train.steps}; its checkpoint, metrics and MLflow run "
          f"{(summary.get('mlflow_run_id') or '(untracked)')[:8]} go on (checkpoint.resume=none starts afresh in a new folder)", flush=True)
    return folder


def _check_tracking_stores(jobs: list[DictConfig]) -> None:
    """Each job's tracking store opened for a moment, in seconds (src/tracking/mlflow_run.py
    store_refusal): a store that cannot be opened is refused here, named, before any rank or MLflow
    run exists, where MLflow's client would retry it for minutes."""
    for uri in dict.fromkeys(cfg.tracking.uri for cfg in jobs if cfg.tracking.enabled):
        refusal = store_refusal(resolve_tracking_uri(uri, Path.cwd()))
        if refusal:
            raise ConfigError(f"tracking.uri={shown_uri(uri)}: {refusal}; or track here: tracking.uri=sqlite:///mlflow.db")


def _warn_ranks_over_cores(jobs: list[DictConfig]) -> None:
    """CPU ranks beyond the cores: each rank gets one OpenMP thread (src/distributed/launch.py) and
    a time-share of a core, and gloo's collectives wait on the slowest, so the run crawls; it still
    runs, so this warns and goes on."""
    from src.train.checks import TRAINING_TASKS

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    ranks = sorted({cfg.dist.nproc for cfg in jobs if cfg.backend.name == "cpu" and not cfg.dist.fake and cfg.task.name in TRAINING_TASKS})
    if ranks and ranks[-1] > cores:
        sys.stderr.write(f"warning: dist.nproc={ranks[-1]} CPU ranks on {cores} core(s): the ranks share the cores and the run will be slow; "
                         f"dist.nproc={cores} or fewer uses each core once\n")


def _fail(message: str, code: int = EXIT_BAD_CONFIG) -> None:
    sys.stderr.write(f"error: {message}\n")
    sys.exit(code)


def _sweep_marker(sweep_dir: Path, name: str) -> str | None:
    """Inside a multirun, what the sweep callback left in the sweep directory for its jobs (the
    parent run's id, the keys the sweep varies): files, because a joblib worker or a submitit
    job shares no memory."""
    marker = sweep_dir / name
    return marker.read_text().strip() if marker.exists() else None


def run_job(cfg: DictConfig, ctx: RunContext, multirun: bool) -> dict | None:
    """Run one job. Its task has recorded a failure (src/tasks.py's task_wrapper: summary.json,
    MLflow FAILED or KILLED); here it is reported: in a sweep returned so the sweep goes on, a
    single run exits 1 (130 when interrupted) with the error on one line."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    from src.tasks import failure_message, interruption, run_task

    try:
        summary = run_task(cfg, ctx)
        if not multirun:
            _say_where_it_went(cfg, ctx, summary)
        return summary
    except (KeyboardInterrupt, SignalException) as err:
        # SignalException is an Exception: left to Hydra, it prints ~40 lines and exits 1.
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        where = f"; the run in {ctx.run_dir} is recorded as KILLED" if ctx.run_dir else ""
        _fail(f"{interruption(err)}{where}", code=EXIT_INTERRUPTED)
    except ConfigError as err:
        _fail(str(err))
    except Exception as err:
        message = failure_message(err)
        if multirun:
            return {"task": cfg.task.name, "status": "failed", "error": message}
        _fail(message, code=1)
    return None


def _say_where_it_went(cfg: DictConfig, ctx: RunContext, summary: dict | None) -> None:
    """The last lines of a run: where its files are and how to see it in MLflow."""
    from src.tracking.mlflow_run import experiment_name

    if ctx.run_dir:
        run_dir = Path(ctx.run_dir)
        shown = run_dir.relative_to(ctx.cwd) if run_dir.is_relative_to(ctx.cwd) else run_dir
        log.info("outputs: %s/ (%s)", shown, _listing(run_dir))
    run_id = (summary or {}).get("mlflow_run_id") if isinstance(summary, dict) else None
    if cfg.tracking.enabled and run_id:
        # the runs table of the run's task, by its headline figure (src/tracking/ui_view.py); rank 0
        # of a training run made it (summary's mlflow_hint), a one-shot task's is made here
        hint = summary.get("mlflow_hint")
        if not hint:
            from src.tracking.ui_view import run_hint

            hint = run_hint(ctx.tracking_uri or cfg.tracking.uri, run_id, cfg.task.name, cfg.tracking.uri)
        log.info("MLflow: run %s in experiment '%s'; %s", run_id[:8], experiment_name(cfg), hint)


def _listing(run_dir: Path, most: int = 12) -> str:
    """What the run wrote, as the user will look for it: summary.json first, folders with a slash
    (profile/, checkpoints/), Hydra's and the tracker's hidden files left out."""
    entries = sorted((p for p in run_dir.iterdir() if not p.name.startswith(".")), key=lambda p: (p.name != "summary.json", p.is_dir(), p.name))
    names = [p.name + ("/" if p.is_dir() else "") for p in entries]
    return ", ".join(names[:most]) + (f", and {len(names) - most} more" if len(names) > most else "")


def job_context(hc: DictConfig, tracking_uri: str, run_dir: str, overrides: list[str]) -> RunContext:
    """A job's RunContext from its Hydra config `hc`, for a job that runs (hydra_main) or a sweep
    job whose process died (src/distributed/cluster.py records it)."""
    from hydra.types import RunMode

    cwd = hc.runtime.cwd
    multirun = hc.mode == RunMode.MULTIRUN
    marker = (lambda name: _sweep_marker(Path(hc.sweep.dir), name)) if multirun else (lambda name: None)
    return RunContext(
        run_dir=run_dir,
        cwd=cwd,
        overrides=overrides,
        tracking_uri=resolve_tracking_uri(tracking_uri, cwd),
        parent_run_id=marker(PARENT_RUN_ID_FILE),
        sweep_keys=(marker(SWEEP_KEYS_FILE) or "").split() or None,
        multirun=multirun,
    )


@hydra.main(config_path="../conf", config_name="config", version_base="1.3")
def hydra_main(cfg: DictConfig) -> dict | None:
    from src.config.validate import validate
    from src.distributed.cluster import move_job_log, submitit_job
    from src.fusion.choice import apply_auto_choice
    from src.train.resume_check import check_checkpoints

    hc = HydraConfig.get()
    try:
        finish(cfg, list(hc.overrides.task))  # model=hf: the model its folder holds
    except ConfigError as err:
        _fail(str(err))
    ctx = job_context(hc, cfg.tracking.uri, hc.runtime.output_dir, list(hc.overrides.task))
    move_job_log(hc.runtime.output_dir, submitit_job())  # a submitit task on a node after the first: its own log
    multirun = ctx.multirun
    if multirun:  # sweep.resume=true: a job that finished before hands back its summary, and does not run
        from src.tracking.resume import finished_before
        from src.tracking.search import job_return

        done = finished_before(cfg, hc.sweep.dir, hc.runtime.output_dir, hc.job.num)
        if done is not None:
            return job_return(done, cfg, OmegaConf.select(hc, "sweeper._target_"))
    try:
        validate(cfg)  # again on the node that runs it: its GPUs are the ones that count
        apply_auto_choice(cfg, ctx.cwd, run_dir=hc.runtime.output_dir)
        # again where the job runs (a requeued SLURM job resumes from the checkpoint its last attempt saved)
        verified = check_checkpoints(cfg, Path(hc.runtime.output_dir))
    except ConfigError as err:
        _fail(str(err))
    ctx.verified_checkpoint = str(verified) if verified is not None else None
    if not multirun:
        return run_job(cfg, ctx, multirun=False)
    # a searching sweeper (Optuna) takes the objective's value back, the basic one the summary
    return job_return(run_job(cfg, ctx, multirun=True), cfg, OmegaConf.select(hc, "sweeper._target_"))


def run_as_worker(overrides: list[str], config_dir: str | None = None) -> None:
    """Entry under torchrun / srun: this process is already one rank of the run."""
    from src.config.validate import validate
    from src.fusion.choice import apply_auto_choice

    cfg = compose_config(overrides, with_hydra=True, config_dir=config_dir)
    adopt_torchrun_shape(cfg, overrides)
    validate(cfg, as_worker=True)
    apply_auto_choice(cfg, os.getcwd(), measure=False)
    run_dir = Path(OmegaConf.select(cfg, "hydra.run.dir"))
    with open_dict(cfg):
        del cfg["hydra"]
    rank = int(os.environ.get("RANK", os.environ.get("SLURM_PROCID", 0)))
    cwd = os.getcwd()
    if rank == 0:
        run_dir = stable_run_dir(run_dir if run_dir.is_absolute() else Path(cwd) / run_dir)
    ctx = RunContext(
        run_dir=str(run_dir) if rank == 0 else None,
        cwd=cwd,
        overrides=overrides,
        tracking_uri=resolve_tracking_uri(cfg.tracking.uri, cwd),
    )
    run_job(cfg, ctx, multirun=False)


# A value's runs of characters that Hydra's override grammar reads unquoted are ASCII only (its
# lexer's ID and UNQUOTED_CHAR); these characters delimit such runs (lists, dicts, sweeps, calls).
_DELIMITERS = re.compile(r"""[^\s,\[\]{}():='"]+""")


def quote_non_ascii(args: list[str]) -> list[str]:
    """`tracking.run_name=expérience` as `tracking.run_name='expérience'`: Hydra's grammar takes
    any character inside quotes and none but ASCII outside, so each bare run of characters holding
    a non-ASCII one is quoted. A value the user quoted, a flag or a key is left as it is."""
    quoted = []
    for arg in args:
        key, sep, value = arg.partition("=")
        if sep and not arg.startswith("-") and key.isascii() and not value.isascii() and not any(q in value for q in "'\""):
            arg = key + sep + _DELIMITERS.sub(lambda m: m.group() if m.group().isascii() else f"'{m.group()}'", value)
        quoted.append(arg)
    return quoted


def _args_parser() -> argparse.ArgumentParser:
    """What preflight needs of Hydra's command line (its own parser is in hydra._internal): the
    overrides and -m; the flags that take a value are declared so that the value is not taken for
    an override (`-cn NAME`), and Hydra itself parses the command again."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("overrides", nargs="*")
    parser.add_argument("--multirun", "-m", action="store_true")
    for flags in (("--cfg", "-c"), ("--package", "-p"), ("--config-path", "-cp"), ("--config-name", "-cn"),
                  ("--config-dir", "-cd"), ("--experimental-rerun",)):
        parser.add_argument(*flags)
    parser.add_argument("--info", "-i", nargs="?", const="all")
    for flags in (("--help", "-h"), ("--hydra-help",), ("--version",), ("--resolve",), ("--run", "-r"), ("--shell-completion", "-sc")):
        parser.add_argument(*flags, action="store_true")
    return parser


def main() -> None:
    # MLflow's own INFO notes ("Creating initial MLflow database tables...") would reach the console
    # of every run on a new store; the ranks and the metric writer inherit this.
    os.environ.setdefault("MLFLOW_LOGGING_LEVEL", "WARNING")

    for arg in sys.argv[1:]:  # bytes that are not UTF-8 arrive as surrogates, which MLflow cannot store
        bad = next((c for c in arg if "\udc80" <= c <= "\udcff"), None)
        if bad is not None:
            shown = arg.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
            _fail(f"{shown}: byte 0x{ord(bad) - 0xDC00:02x} is not UTF-8, and the run's settings are stored as UTF-8 text "
                  "(MLflow's params, config.yaml); rename the file or folder")
    sys.argv[1:] = quote_non_ascii(sys.argv[1:])  # Hydra parses sys.argv again in hydra_main
    args, _ = _args_parser().parse_known_args(sys.argv[1:])
    inspecting = any(a.split("=")[0] in _INSPECT_FLAGS for a in sys.argv[1:])
    try:
        if not inspecting:
            from src.distributed.env import launched_as_worker  # it imports torch, which inspecting needs not

            if launched_as_worker():
                run_as_worker(args.overrides, args.config_dir)
                return
            folder = preflight(args.overrides, args.multirun, args.config_dir)
            if folder is not None:  # Hydra parses sys.argv again in hydra_main: it runs there
                path = claim_folder(folder.path) if folder.new else folder.path
                path = path.relative_to(Path.cwd()) if path.is_relative_to(Path.cwd()) else path  # as Hydra's own default reads
                sys.argv.append(f"{folder.key}='{path}'" if "'" not in str(path) else f'{folder.key}="{path}"')
    except ConfigError as err:
        _fail(str(err))
    except KeyboardInterrupt:  # Ctrl-C while composing: nothing started yet
        _fail("interrupted by SIGINT before the run started", code=EXIT_INTERRUPTED)
    if args.help or args.hydra_help:
        from src.config.help import share_config_store

        share_config_store()
    hydra_main()


if __name__ == "__main__":
    main()
