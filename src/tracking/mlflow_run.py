"""One MLflow run per run (a child of the sweep's parent run inside a Hydra multirun), from rank 0 only.

Uses MlflowClient with an explicit run id (no fluent global state), hands step metrics to a
writer process (src/tracking/writer.py) so a slow store never stalls a step, and always ends the
run: FINISHED, FAILED (with the error as a tag) or KILLED on Ctrl-C. A tracking server that cannot
be reached is reported once; the run goes on and its metrics stay in the run directory.
"""
from __future__ import annotations

import json
import logging
import math
import os
import platform
import subprocess
import time
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

from omegaconf import OmegaConf

from src.tracking.writer import MetricWriter

log = logging.getLogger(__name__)

RUN_ID_FILE = ".mlflow_run_id"
# The elastic run (TORCHELASTIC_RUN_ID) that opened the MLflow run: a later attempt of the same
# elastic run continues it. Not the agent's restart count: on several nodes each agent counts its
# own restarts, and the nodes whose ranks did not fail restart with a count of 0.
ELASTIC_RUN_FILE = ".elastic_run_id"
PARENT_RUN_ID_FILE = ".mlflow_parent_run_id"
SWEEP_KEYS_FILE = ".sweep_keys"  # the keys a sweep varies, one a line: its jobs are named by them
# What the store did not take (a server down at the end, or from the start): enough to make or finish
# the run later, `python -m src.tracking.sync RUN_DIR` (src/tracking/sync.py), which deletes it when done.
UNSYNCED_FILE = ".mlflow_unsynced.json"


def sync_hint(run_dir: Path | None) -> str:
    return f"`python -m src.tracking.sync {run_dir}` stores it once the server answers" if run_dir is not None else "it is not stored"


class TrackingUnavailable(RuntimeError):
    pass


def resolve_tracking_uri(uri: str, cwd: str | os.PathLike) -> str:
    """`sqlite:///mlflow.db` is relative to where the run was started; make it absolute so spawned
    ranks and sweep jobs all write the same store."""
    prefix = "sqlite:///"
    if uri.startswith(prefix) and not uri.startswith(prefix + "/"):
        return prefix + str((Path(cwd) / uri[len(prefix):]).resolve())
    return uri


_READY_STORES: set[str] = set()


def client_for(uri: str):
    """An MlflowClient of `uri`. A SQLite store is made (its tables created) under a lock on its
    folder: two runs started together on a new store raced MLflow's schema migration, and one died
    with "table _alembic_tmp_trace_tags already exists" (MLflow 3.17, 2 of 2 tries)."""
    import fcntl

    from mlflow import MlflowClient

    # MLflow's own "View run / View experiment at" lines link the experiment without the view, which
    # opens MLflow 3's GenAI overview; a run's and a sweep's last line give src/tracking/ui_view.py's URL
    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")
    if not uri.startswith("sqlite:///") or uri in _READY_STORES:
        return MlflowClient(tracking_uri=uri)
    folder = Path(uri[len("sqlite:///"):]).parent
    fd = os.open(folder if folder.is_dir() else ".", os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # held while the client makes the tables; a second run waits, then finds them
        client = MlflowClient(tracking_uri=uri)
    finally:
        fcntl.flock(fd, fcntl.LOCK_UN)
        os.close(fd)
    _READY_STORES.add(uri)
    return client


def check_reachable(uri: str, timeout_s: float) -> None:
    """A tracking server must answer /health within the timeout; MLflow's own client would retry
    for minutes before failing."""
    if not uri.startswith(("http://", "https://")):
        return
    import requests

    try:
        requests.get(uri.rstrip("/") + "/health", timeout=timeout_s).raise_for_status()
    except requests.RequestException as err:
        raise TrackingUnavailable(f"MLflow server at {uri} did not answer ({type(err).__name__})") from None


DATABASE_PORTS = {"postgresql": 5432, "mysql": 3306, "mssql": 1433}


def shown_uri(uri: str) -> str:
    """`uri` with its password starred: it goes into error lines and logs."""
    parts = urlsplit(uri)
    if parts.password is None:
        return uri
    return urlunsplit(parts._replace(netloc=parts.netloc.replace(f":{parts.password}@", ":***@", 1)))


def store_refusal(uri: str, timeout_s: float = 3.0) -> str | None:
    """Why the store at `uri` cannot be opened, or None: a port outside 1-65535, a sqlite path that is
    a folder, a database server that does not accept a connection within `timeout_s`. MLflow's own
    client retries such a store for minutes before it fails, naming neither the URI nor the setting.
    A tracking server (http) that does not answer is not refused: the run goes on and keeps its
    metrics for `python -m src.tracking.sync`."""
    import socket

    parts = urlsplit(uri)
    scheme = parts.scheme.split("+", 1)[0]
    if scheme == "sqlite":
        db = Path(uri[len("sqlite:///"):]) if uri.startswith("sqlite:///") else None
        if db is not None and db.is_dir():
            return f"{db} is a folder, not a database file; name a file in it, e.g. sqlite:///{db / 'mlflow.db'}"
        return None
    if scheme not in ("http", "https", *DATABASE_PORTS):
        return None
    try:
        port = parts.port
    except ValueError:
        return f"port {parts.netloc.rsplit(':', 1)[-1]} is not a port (1-65535)"
    if scheme not in DATABASE_PORTS or not parts.hostname:  # no host: a local socket, which the driver finds
        return None
    port = port or DATABASE_PORTS[scheme]
    try:
        socket.create_connection((parts.hostname, port), timeout=timeout_s).close()
    except OSError as err:
        reason = "no answer" if isinstance(err, TimeoutError) else (err.strerror or type(err).__name__)
        return f"the {scheme} server at {parts.hostname}:{port} does not accept a connection ({reason} within {timeout_s:g} s)"
    return None


def is_server(uri: str) -> bool:
    return uri.startswith(("http://", "https://"))


def wait_for_server(uri: str, within_s: float) -> bool:
    """Poll /health with backoff (0.5 s doubling to 5 s) until the server answers or `within_s`
    passes: a server restarted mid-run answers again in about 5 s."""
    deadline, delay = time.monotonic() + within_s, 0.5
    while True:
        try:
            check_reachable(uri, min(5.0, max(0.5, deadline - time.monotonic())))
            return True
        except TrackingUnavailable:
            if time.monotonic() + delay > deadline:
                return False
            time.sleep(delay)
            delay = min(2 * delay, 5.0)


def ui_hint(uri: str) -> str:
    """How to open the MLflow UI on the store a run wrote to, as a command to paste."""
    if uri.startswith(("http://", "https://")):
        return f"open {uri.rstrip('/')} in a browser"
    return f"see it with `mlflow ui --backend-store-uri {uri}`, then open http://127.0.0.1:5000"


def flatten(tree: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def git_state(cwd: str | os.PathLike) -> dict[str, str]:
    def git(*args: str) -> str:
        return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=10).stdout.strip()

    try:
        commit = git("rev-parse", "HEAD")
        dirty = bool(git("status", "--porcelain", "--untracked-files=no"))
    except (OSError, subprocess.SubprocessError):
        return {}
    return {"git.commit": commit, "git.dirty": str(dirty).lower()} if commit else {}


def varying_keys(overrides: list[str]) -> list[str]:
    """The keys a sweep varies (`precision=fp32,bf16` -> precision), in the order given; hydra.*
    and tracking.* are how a sweep runs, not what it compares."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    try:
        parsed = OverridesParser.create().parse_overrides([o for o in overrides if not _is_plumbing(o)])
    except Exception:  # a sweeper's own syntax: every job is then named by all its overrides
        return []
    return [o.key_or_group for o in parsed if o.is_sweep_override()]


def _is_plumbing(override: str) -> bool:
    return override.lstrip("+~").startswith(("hydra", "tracking."))


def _rounded(value: str) -> str:
    """A float as 4 significant digits (Optuna's 0.0012520653814999472 as 0.001252); anything else as given."""
    try:
        number = float(value)
    except ValueError:
        return value
    return value if value.lstrip("+-").isdigit() or not math.isfinite(number) else f"{number:.4g}"


def _name_part(cfg: Any, override: str) -> tuple[int, str]:
    """(order, text) of one override in a run's name: a config group's option by itself (`fp32`,
    `fsdp2`, `edge`: the option names its group), before settings as `key=value`."""
    key, _, value = override.lstrip("+~").partition("=")
    is_group = key == "exp" or ("." not in key and "," not in value and OmegaConf.is_dict(OmegaConf.select(cfg, key, default=None)))
    if is_group:
        return 0, value
    return 1, f"{key}={_rounded(value) if ',' not in value else value}"


def default_run_name(cfg: Any, overrides: list[str], sweep_keys: list[str] | None = None) -> str:
    """What tells this run apart, shortest first: MLflow's runs table cuts a name at about 25
    characters, so a 2 x 2 sweep's jobs read `fp32 none` and `bf16 fsdp2`, not four names that
    all start `precision=`. In a sweep, only the overrides it varies; never tracking.* or hydra.*."""
    shown = [o.lstrip("+~") for o in overrides if not _is_plumbing(o)]
    if sweep_keys:
        shown = [o for o in shown if o.split("=", 1)[0] in sweep_keys] or shown
    if shown:
        parts = sorted((_name_part(cfg, o) for o in shown), key=lambda part: part[0])  # stable: the command's order within each
        return " ".join(text for _, text in parts)[:250]
    return f"{cfg.task.name}-{cfg.model.name}-{cfg.sharding.name}-{cfg.precision.name}"


DEFAULT_EXPERIMENT = "perflab"
# MLflow 3's experiment type: "custom_model_development" is its "Machine learning" (runs, metrics),
# where an experiment without the tag may open as a GenAI one (traces); src/tracking/ui_view.py says
# what MLflow 3.17's UI reads instead.
EXPERIMENT_KIND = ("mlflow.experimentKind", "custom_model_development")


def experiment_name(cfg: Any) -> str:
    """One experiment per task, the study its runs compare: tracking.experiment when set, else
    'perflab' for task=train and 'perflab-TASK' for the others (perflab-profile, perflab-infer,
    perflab-diagnose, perflab-kernel_bench). A task's runs share their figures, so the runs table
    of one experiment has one set of columns and one headline; a profiled step's tokens/s (under the
    profiler) is no plain step's. Presets (+exp) do not split: fsdp4, fsdp4_tuned and fsdp4_fp8 are
    variants compared side by side; a run's preset is its `exp` param. Never MLflow's catch-all
    'Default'."""
    if cfg.tracking.experiment:
        return cfg.tracking.experiment
    task = cfg.task.name
    return DEFAULT_EXPERIMENT if task == "train" else f"{DEFAULT_EXPERIMENT}-{task}"


def experiment_id(client, name: str) -> str:
    """The id of experiment `name`, created on first use; tagged as a model-training experiment."""
    retire_empty_default(client)
    exp = client.get_experiment_by_name(name)
    if exp is None:
        return client.create_experiment(name, tags=dict([EXPERIMENT_KIND]))
    if EXPERIMENT_KIND[0] not in exp.tags:  # made before the tag was set
        client.set_experiment_tag(exp.experiment_id, *EXPERIMENT_KIND)
    return exp.experiment_id


def retire_empty_default(client) -> None:
    """MLflow's SQL store makes experiment 0, 'Default', whenever it opens a database that lacks it
    (a `mlflow server` at its start, or this project's client on a sqlite: URI); no run here goes to
    it. In a SQLite file (this project's own store) an empty Default is deleted, to MLflow's trash
    (`mlflow experiments restore --experiment-id 0` brings it back), and the store finds it deleted
    and does not make it again. A server's Default is its own: tools that log without naming an
    experiment log there, so it is left alone."""
    if not str(client.tracking_uri).startswith("sqlite:"):
        return
    from mlflow.entities import ViewType

    try:
        default = client.get_experiment("0")
        if default.lifecycle_stage == "active" and default.name == "Default" and not client.search_runs(
                ["0"], run_view_type=ViewType.ALL, max_results=1):
            client.delete_experiment("0")
    except Exception as err:  # another run deleted it first, or a store without one: nothing to retire
        log.debug("Default experiment left as it is: %s", err)


def run_tags(overrides: list[str], world_size: int, device_name: str, cwd: str | os.PathLike, fake: bool = False) -> dict[str, str]:
    import torch

    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = "none"
    tags = {
        "overrides": " ".join(overrides) or "(defaults)",
        "world_size": str(world_size),
        "device": device_name,
        "device_count": str(torch.cuda.device_count() if torch.cuda.is_available() else 0),
        "host": platform.node(),
        "torch": torch.__version__,
        "triton": triton_version,
        "cuda": torch.version.cuda or "none",  # a CPU build has none (str(None) read "None" in the UI)
    }
    tags.update(git_state(cwd))
    if fake:  # its figures are rank 0's alone, collectives faked: a tag to tell it from the real group in the run list
        tags["dist.fake"] = "rank 0 alone, collectives faked"
    return tags


@dataclass(frozen=True)
class RunIdentity:
    uri: str
    experiment: str
    run_name: str
    tags: dict[str, str]
    parent_run_id: str | None


def run_identity(cfg: Any, ctx: Any, world_size: int, device_name: str) -> RunIdentity:
    """Where a job's MLflow run lives, its name and tags: one place for the run rank 0 opens, a
    one-shot task's run, and the FAILED record of a job that died before either."""
    return RunIdentity(
        uri=ctx.tracking_uri or cfg.tracking.uri,
        experiment=experiment_name(cfg),
        run_name=cfg.tracking.run_name or default_run_name(cfg, ctx.overrides, ctx.sweep_keys),
        tags=run_tags(ctx.overrides, world_size, device_name, ctx.cwd, fake=bool(cfg.dist.fake)),
        parent_run_id=ctx.parent_run_id,
    )


class NullTracker:
    run_id: str | None = None

    def start(self) -> None: ...
    def log_step(self, step: int, metrics: Mapping[str, float | None]) -> None: ...
    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None: ...
    def set_tags(self, tags: Mapping[str, str]) -> None: ...
    def finish(self, status: str, summary: Mapping[str, Any] | None = None, error: str | None = None) -> None: ...
    def view_hint(self, task: str, shown_uri: str) -> str | None:
        return None


class MlflowTracker(NullTracker):
    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        params: Mapping[str, Any],
        tags: Mapping[str, str],
        run_dir: Path | None,
        metric_writer: bool = True,
        parent_run_id: str | None = None,
        system_metrics_interval_s: float = 0.0,
        connect_timeout_s: float = 5.0,
        continue_run_id: str | None = None,
        retry_s: float = 60.0,
    ):
        self.uri, self.experiment, self.run_name = uri, experiment, run_name
        self.params, self.tags, self.run_dir = dict(params), dict(tags), run_dir
        self.use_writer, self.parent_run_id = metric_writer, parent_run_id
        self.system_metrics_interval_s, self.connect_timeout_s = system_metrics_interval_s, connect_timeout_s
        self.client = None
        self.run_id = None
        self.writer = None
        self.continue_run_id = continue_run_id
        self.logged_steps: set[int] = set()
        self.retry_s = retry_s
        self.server_lost = False
        self.tags_set: dict[str, str] = {}  # every tag set after the start: the sync sets them again

    def _lose(self, what: str, reason: str) -> None:
        """The store stopped answering: skip the rest of the record, and say once how to store it later."""
        self.server_lost = True
        where = f" in {self.run_dir}" if self.run_dir is not None else ""
        log.warning("MLflow store at %s did not take %s (%s); the run's record stays%s: %s",
                    self.uri, what, reason, where, sync_hint(self.run_dir))

    def unsynced(self, status: str, error: str | None) -> dict[str, Any]:
        return {"uri": self.uri, "run_id": self.run_id, "experiment": self.experiment, "run_name": self.run_name,
                "parent_run_id": self.parent_run_id, "tags": {**self.tags, **self.tags_set},
                "params": {k: str(v)[:6000] for k, v in self.params.items()}, "status": status, "error": error}

    def _server_call(self, what: str, call):
        """`call()` against the store; a server that stopped answering gets `retry_s` to come back
        (one more try then), else the rest of the run's record is skipped with one warning: the
        run's files stay in its directory. MLflow's own retries (7, backing off to about 4 minutes
        a call) are off for a server URI (start()), so a dead server costs retry_s once, not
        minutes per artifact."""
        if self.server_lost:
            return None
        try:
            return call()
        except Exception as first:
            err = first  # what the warning names, unless the retry fails too (a server still down: no retry)
            if is_server(self.uri) and wait_for_server(self.uri, self.retry_s):
                try:
                    return call()
                except Exception as again:
                    err = again
            self._lose(what, f"{type(err).__name__}: {(str(err).splitlines() or [''])[0][:200]}")
            return None

    def start(self) -> None:
        check_reachable(self.uri, self.connect_timeout_s)
        if is_server(self.uri):  # _server_call retries, bounded by tracking.retry_s
            os.environ.setdefault("MLFLOW_HTTP_REQUEST_MAX_RETRIES", "0")
        # runs that log step metrics (one-shot runs, diagnose, log directly): the writer imports MLflow
        # and opens the store while this process does, and learns the run id once there is one
        if self.use_writer:
            self.writer = MetricWriter(self.uri, self.system_metrics_interval_s, self.retry_s)
        try:
            self._open_run()
        except BaseException:
            if self.writer is not None:  # told no run (its input ends), it stores nothing and exits 0
                self.writer.close(timeout_s=30)
                self.writer = None
            raise
        if self.writer is not None:
            self.writer.begin(self.run_id)

    def _open_run(self) -> None:
        """A new run, or the one an elastic restart continues."""
        from mlflow.entities import Param

        self.client = client_for(self.uri)
        if self.continue_run_id:  # an elastic restart: the same run goes on, its curves continue
            self.run_id = self.continue_run_id
            previous = self.client.get_run(self.run_id).data.tags
            restart = str(int(previous.get("restarts", "0")) + 1)
            self.client.update_run(self.run_id, status="RUNNING")
            self.client.set_tag(self.run_id, "restarts", restart)
            stale = previous.get("error")
            if stale:  # the attempt that failed set it; kept as what caused the restart, not as this run's error
                self.client.set_tag(self.run_id, f"restart_{restart}.cause", stale[:5000])
                self.client.delete_tag(self.run_id, "error")
            if "preempted" in previous:  # a stop signal ended the last attempt; kept under the attempt's number
                self.client.set_tag(self.run_id, f"restart_{restart}.cause",
                                    f"{previous['preempted']} at step {previous.get('preempted_at_step', '?')}")
                for key in ("preempted", "preempted_at_step"):
                    if key in previous:
                        self.client.delete_tag(self.run_id, key)
            # Steps after the last checkpoint run again, bit for bit: log each step once.
            self.logged_steps = {m.step for m in self.client.get_metric_history(self.run_id, "loss")}
            log.info("MLflow run %s continues after restart %s", self.run_id, restart)
            return
        exp_id = experiment_id(self.client, self.experiment)
        tags = dict(self.tags)
        if self.parent_run_id:
            tags["mlflow.parentRunId"] = self.parent_run_id
        run = self.client.create_run(exp_id, run_name=self.run_name, tags=tags)
        self.run_id = run.info.run_id
        if self.run_dir is not None:
            (self.run_dir / RUN_ID_FILE).write_text(self.run_id)
            if "TORCHELASTIC_RUN_ID" in os.environ:
                (self.run_dir / ELASTIC_RUN_FILE).write_text(os.environ["TORCHELASTIC_RUN_ID"])
        # MLflow caps a param value at 6000 characters and a batch at 100 params.
        params = [Param(k, str(v)[:6000]) for k, v in self.params.items()]
        for i in range(0, len(params), 100):
            self.client.log_batch(self.run_id, params=params[i : i + 100])
        log.info("MLflow run %s in experiment '%s' at %s", self.run_id, self.experiment, self.uri)

    def log_step(self, step: int, metrics: Mapping[str, float | None]) -> None:
        if step not in self.logged_steps:
            self.writer.log(step, metrics)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.tags_set.update(tags)
        for k, v in tags.items():
            self._server_call(f"tag {k}", lambda k=k, v=v: self.client.set_tag(self.run_id, k, v))

    def log_artifact(self, path: str | os.PathLike, artifact_path: str | None = None) -> None:
        if Path(path).exists():
            self._server_call(f"artifact {Path(path).name}", lambda: self.client.log_artifact(self.run_id, str(path), artifact_path))

    def finish(self, status: str, summary: Mapping[str, Any] | None = None, error: str | None = None) -> None:
        try:
            if self.writer is not None:
                stored = self.writer.close()
                self.writer = None
                if not stored and not self.server_lost:
                    self._lose("every step metric", f"not answering for tracking.retry_s={self.retry_s:g} s after training ended")
            if summary:
                from mlflow.entities import Metric, RunTag

                now = int(time.time() * 1000)
                headline = [Metric(f"summary.{k}", float(v), now, 0) for k, v in summary.items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
                # a figure the run could not measure says why, beside the figures (`n/a` in summary.json's `na`)
                missing = [RunTag(f"na.{k}", str(v)[:5000]) for k, v in (summary.get("na") or {}).items()]
                self._server_call("the summary metrics", lambda: self.client.log_batch(self.run_id, metrics=headline, tags=missing))
            if error:
                self._server_call("the error tag", lambda: self.client.set_tag(self.run_id, "error", error[:5000]))
        finally:
            self._server_call(f"the run's end ({status})", lambda: self.client.set_terminated(self.run_id, status=status))
            if self.server_lost and self.run_dir is not None:
                write_json(self.run_dir / UNSYNCED_FILE, self.unsynced(status, error))

    def view_hint(self, task: str, shown_uri: str) -> str | None:
        """The run's last line on MLflow (src/tracking/ui_view.py run_hint), made with this tracker's
        client: a launcher that prints it from the summary need not import MLflow (about 2 s of CPU)."""
        if self.client is None or self.server_lost:
            return None
        from src.tracking.ui_view import run_hint

        return run_hint(self.uri, self.run_id, task, shown_uri, client=self.client)


class OfflineTracker(NullTracker):
    """A run whose store did not answer at its start: it goes on untracked, and leaves what the sync
    needs to make its MLflow run later (UNSYNCED_FILE)."""

    def __init__(self, tracker: MlflowTracker):
        self.tracker = tracker

    def set_tags(self, tags: Mapping[str, str]) -> None:
        self.tracker.tags_set.update(tags)

    def finish(self, status: str, summary: Mapping[str, Any] | None = None, error: str | None = None) -> None:
        if self.tracker.run_dir is not None:
            write_json(self.tracker.run_dir / UNSYNCED_FILE, self.tracker.unsynced(status, error))


def start_tracker(tracker: NullTracker) -> NullTracker:
    """Start `tracker`; if its store cannot be reached, say so once and go on without it."""
    try:
        tracker.start()
        return tracker
    except TrackingUnavailable as err:
        run_dir = getattr(tracker, "run_dir", None)
        if run_dir is None:
            log.warning("%s; the run goes on untracked, its figures stay in the run directory (metrics.jsonl, summary.json)", err)
            return NullTracker()
        log.warning("%s; the run goes on untracked, its figures stay in %s: %s", err, run_dir, sync_hint(run_dir))
        return OfflineTracker(tracker)


def task_tracker(cfg: Any, ctx: Any, device_name: str) -> NullTracker:
    """The MLflow run of a one-shot task (diagnose, kernel_bench): params, tags, a child of the
    sweep's parent; metrics logged once at the end. NullTracker when tracking is off."""
    from omegaconf import OmegaConf

    if not cfg.tracking.enabled:
        return NullTracker()
    ident = run_identity(cfg, ctx, 1, device_name)
    return start_tracker(MlflowTracker(
        uri=ident.uri, experiment=ident.experiment, run_name=ident.run_name,
        params=flatten(OmegaConf.to_container(cfg, resolve=True)), tags=ident.tags,
        run_dir=Path(ctx.run_dir) if ctx.run_dir else None, metric_writer=False, parent_run_id=ident.parent_run_id,
        connect_timeout_s=cfg.tracking.connect_timeout_s, retry_s=cfg.tracking.retry_s,
    ))


RUN_ARTIFACTS = ("summary.json", "config.yaml", "curves.png", "metrics.jsonl", "run.log", ".hydra/overrides.yaml")


def record_failed_run(uri: str, experiment: str, run_name: str, error: str, tags: Mapping[str, str], run_dir: Path, status: str = "FAILED") -> None:
    """A job that failed before rank 0 opened its run (or whose rank 0 died) still shows as FAILED,
    with what its run directory holds: run.log above all, which says why it failed."""

    client = client_for(uri)
    id_file = run_dir / RUN_ID_FILE
    if id_file.exists():
        run_id = id_file.read_text().strip()
        still_running = client.get_run(run_id).info.status == "RUNNING"
    else:
        exp_id = experiment_id(client, experiment)
        run_id = client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id
        still_running = True
    for name in RUN_ARTIFACTS:
        path = run_dir / name
        if path.exists():
            client.log_artifact(run_id, str(path))
    if still_running:  # rank 0 ended it itself when it could (its error tag holds the traceback)
        client.set_tag(run_id, "error", error[:5000])
        client.set_terminated(run_id, status=status)
    else:
        from src.distributed.launch import _PEER_GONE

        recorded = client.get_run(run_id).data.tags.get("error", "")
        if _PEER_GONE.search(recorded) and not _PEER_GONE.search(error):
            # rank 0 recorded that a peer left (a consequence); the launcher's line names the cause
            client.set_tag(run_id, "error", error[:5000])


def write_json(path: Path, payload: Mapping[str, Any]) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str))
    tmp.replace(path)
