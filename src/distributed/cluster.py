"""Past one machine: SLURM (and submitit's local executor) through Hydra's submitit launcher.

One elastic agent per node, not one SLURM task per GPU. Each submitit task is one node's agent: it
runs the Hydra job, which starts the node's `dist.nproc` ranks through the same elastic launcher
as a single machine (src/distributed/launch.py), with `dist.nnodes` agents meeting at a c10d
rendezvous on the job's first node. That is torchrun's model, chosen because:

- `dist.max_restarts` means the same everywhere: a rank that dies on any node restarts the ranks
  of every node, which resume from the last checkpoint. With a task per GPU, srun ends the whole
  step when one task dies, and only requeueing the job can recover;
- the resolved config travels to the ranks as a dict, composed once per node, and the rank
  failure report (`error: rank N failed: ...`, the per-rank notes) is the agent's, as on one
  machine; with a task per GPU, N x G processes would each compose the config and each run
  Hydra's job set-up in the one job folder.

What it costs: SLURM binds CPUs and GPUs per task, so a node's ranks share its task's binding
(the agent splits the cores with OMP_NUM_THREADS; each rank takes cuda:LOCAL_RANK).

Here also: the refusals of launcher settings that cannot run (check_launcher), and what a process
under an external torchrun adopts from it (adopt_torchrun_shape, stable_run_dir).

The launchers (hydra_plugins/perflab_submitit_launcher: Hydra takes plugins from that package
only) are the plugin's, but a job whose process died without a result (killed by the scheduler,
out of memory, a SIGKILL) is recorded FAILED, and the sweep goes on. Their settings, with nodes
and GPUs taken from dist.*, are in src/config/schema.py.
"""
from __future__ import annotations

import logging
import os
import random
import signal
import subprocess
from dataclasses import dataclass
from pathlib import Path

from omegaconf import DictConfig

log = logging.getLogger("src.cluster")

# submitit's own choice for MASTER_PORT (helpers.TorchDistributedEnvironment): every node derives
# the same port from the job id, so they meet without talking first.
_PORT_RANGE = (20000, 60000)


@dataclass(frozen=True)
class SubmititJob:
    """What submitit says about the job this process runs in."""

    job_id: str
    num_nodes: int
    node: int
    hostnames: tuple[str, ...]

    @property
    def rendezvous_endpoint(self) -> str:
        """HOST:PORT on the job's first node, the same on every node of the job."""
        return f"{self.hostnames[0]}:{random.Random(self.job_id).randint(*_PORT_RANGE)}"


def submitit_job() -> SubmititJob | None:
    """The submitit job this process is a task of (SUBMITIT_EXECUTOR is set in its tasks), or None."""
    if not os.environ.get("SUBMITIT_EXECUTOR"):
        return None
    import submitit

    env = submitit.JobEnvironment()
    return SubmititJob(str(env.job_id), env.num_nodes, env.node, tuple(env.hostnames))


def _ignore_sigterm() -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def scontrol_requeue(job_id: str, check: bool = False) -> subprocess.CompletedProcess:
    """`scontrol requeue JOB_ID` that outlives the job's own end. slurmctld ends the requeued job at
    once (SIGTERM to every process of it) and that may reach the scontrol client before it has
    exited: CI's SLURM test saw `scontrol requeue` die of SIGTERM (1 of about 10 suites, a loaded
    2-core machine), submitit took that for a failed requeue, and the job ended failed though SLURM
    had requeued it. The client ignores SIGTERM (SIG_IGN survives exec) and exits on its own once
    slurmctld has answered; SIGKILL after the job's KillWait still ends it."""
    return subprocess.run(["scontrol", "requeue", job_id], capture_output=True, text=True, timeout=60, check=check,
                          preexec_fn=_ignore_sigterm)


def requeue_through(handler) -> None:
    """Give submitit's signal handler (its SignalHandler's bound checkpoint_and_try_requeue) a requeue
    made by scontrol_requeue. submitit's SlurmJobEnvironment._requeue (submitit 1.5.4) runs
    `scontrol requeue` as it comes; this replaces it on that one environment object, with the same
    log line ("Requeued job ID (N remaining timeouts)"). Handlers without an `env` are left alone."""
    env = getattr(getattr(handler, "__self__", None), "env", None)
    if env is None or type(env).__name__ != "SlurmJobEnvironment":
        return
    from submitit.core import logger

    def _requeue(countdown: int) -> None:
        scontrol_requeue(str(env.job_id), check=True)
        logger.get_logger().info(f"Requeued job {env.job_id} ({countdown} remaining timeouts)")

    env._requeue = _requeue


def node_log_name(job: SubmititJob | None) -> str:
    """The node's log in the shared job folder: run.log on the first node, run_node<N>.log on the
    others (two nodes appending to one file on a network filesystem interleave, or lose, lines)."""
    return "run.log" if job is None or job.node == 0 else f"run_node{job.node}.log"


def move_job_log(run_dir: str, job: SubmititJob | None) -> None:
    """Hydra opened <run_dir>/run.log for this job's log on every node; on nodes after the first,
    point that handler at the node's own file."""
    name = node_log_name(job)
    if name == "run.log":
        return
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, logging.FileHandler) and Path(handler.baseFilename).name == "run.log":
            replacement = logging.FileHandler(Path(run_dir) / name)
            replacement.setFormatter(handler.formatter)
            replacement.setLevel(handler.level)
            root.removeHandler(handler)
            handler.close()
            root.addHandler(replacement)


SUBMITIT_LAUNCHERS = ("submitit_local", "submitit_slurm")


def check_launcher(launcher: str, overrides: list[str], jobs: list, config_dir: str | None = None) -> None:
    """Settings a parallel or cluster launcher cannot run, refused before anything is submitted;
    `jobs`: each job's composed config; `config_dir`: Hydra's --config-dir, searched as Hydra does."""
    from src.config import job_gpus_per_node, job_nodes
    from src.config.compose import ConfigError, compose_config

    if launcher == "basic" or not jobs:
        return
    tracking = jobs[0].tracking
    if tracking.enabled and tracking.uri.startswith("sqlite"):
        raise ConfigError(
            f"hydra/launcher={launcher} runs jobs in parallel, but tracking.uri={tracking.uri} takes one writer at a time "
            "and would lose runs; start `mlflow server --backend-store-uri sqlite:///mlflow.db --port 5000` and pass "
            f"tracking.uri=http://127.0.0.1:5000, or drop hydra/launcher={launcher}"
        )
    if launcher not in SUBMITIT_LAUNCHERS:
        return
    if launcher == "submitit_slurm" and tracking.enabled and _is_loopback(tracking.uri):
        raise ConfigError(
            f"tracking.uri={tracking.uri} is this machine's loopback, which the cluster's nodes cannot reach; start the server "
            "with --host 0.0.0.0 (docs/CLUSTER.md) and pass tracking.uri=http://THIS_HOST:5000"
        )
    # The launcher's settings are resolved once, from the sweep's config without what it varies
    # (as Hydra composes it), so `nodes: ${dist.nnodes}` takes the value every job shares.
    from hydra.core.override_parser.overrides_parser import OverridesParser

    fixed = [o for o, parsed in zip(overrides, OverridesParser.create().parse_overrides(overrides)) if not parsed.is_sweep_override()]
    hydra = compose_config(fixed, with_hydra=True, config_dir=config_dir).hydra.launcher
    if hydra.tasks_per_node != 1:
        raise ConfigError(
            f"hydra.launcher.tasks_per_node={hydra.tasks_per_node}: perflab runs one task per node, an elastic agent that starts "
            f"dist.nproc ranks there; set dist.nproc={hydra.tasks_per_node} and leave tasks_per_node=1 (docs/CLUSTER.md says why)"
        )
    for cfg in jobs:
        # each job's own shape, by the resolvers that give the launcher its settings (dist.fake: one node, one GPU)
        nodes, gpus = job_nodes(cfg.dist.nnodes, cfg.dist.fake), job_gpus_per_node(cfg.backend.device_type, cfg.dist.nproc, cfg.dist.fake)
        if nodes != hydra.nodes:
            if cfg.dist.fake:
                raise ConfigError(f"dist.fake=true runs rank 0 alone on one node, but hydra.launcher.nodes={hydra.nodes} (the sweep's, without what "
                                  "it varies) would start it on each; one sbatch array has one shape: sweep dist.fake in separate commands")
            fix = ("submitit's local executor runs one node: use dist.nnodes=1, or hydra/launcher=submitit_slurm" if launcher == "submitit_local"
                   else "one sbatch array has one shape: sweep dist.nnodes in separate commands")
            raise ConfigError(f"dist.nnodes={cfg.dist.nnodes} but hydra.launcher.nodes={hydra.nodes} (the sweep's dist.nnodes, without what it varies); {fix}")
        if gpus is not None and hydra.gpus_per_node is not None and gpus > hydra.gpus_per_node:
            raise ConfigError(f"dist.nproc={cfg.dist.nproc} but hydra.launcher.gpus_per_node={hydra.gpus_per_node} (the sweep's dist.nproc, without "
                              "what it varies); one sbatch array has one shape: sweep dist.nproc in separate commands")


def _is_loopback(uri: str) -> bool:
    from urllib.parse import urlparse

    host = urlparse(uri).hostname or ""
    return host in ("localhost", "::1") or host.startswith("127.")


# torchrun's flag for each dist.* setting, and the variable through which its workers see it
_TORCHRUN_SHAPE = {"nproc": ("--nproc-per-node", "LOCAL_WORLD_SIZE"), "nnodes": ("--nnodes", "GROUP_WORLD_SIZE"),
                   "max_restarts": ("--max-restarts", "TORCHELASTIC_MAX_RESTARTS")}


def adopt_torchrun_shape(cfg: DictConfig, overrides: list[str]) -> None:
    """Under torchrun its flags decide how many ranks, nodes and restarts there are: write them into
    dist.* (so config.yaml and the MLflow params say what ran), and refuse a dist.* override that
    says otherwise, which would be silently ignored."""
    from src.config.compose import ConfigError

    for key, (flag, variable) in _TORCHRUN_SHAPE.items():
        if variable not in os.environ:
            continue
        actual = int(os.environ[variable])
        given = next((o for o in overrides if o.lstrip("+").split("=", 1)[0] == f"dist.{key}"), None)
        if given is not None and cfg.dist[key] != actual:
            raise ConfigError(f"{given}: under torchrun, its {flag} decides ({actual} here); drop {given.lstrip('+')} or pass {flag}={cfg.dist[key]} to torchrun")
        cfg.dist[key] = actual
    if cfg.dist.nnodes > 1 and cfg.dist.max_restarts > 0:
        # torchrun's agents each count their own restarts and share one store through every
        # attempt: a restarted rank cannot tell which keys are this attempt's, and waits forever.
        raise ConfigError(
            f"torchrun --nnodes={cfg.dist.nnodes} --max-restarts={cfg.dist.max_restarts}: restarts across nodes need perflab's own agents; "
            f"run `python -m src.run dist.nnodes={cfg.dist.nnodes} dist.nproc={cfg.dist.nproc} dist.rdzv_endpoint=HOST:PORT "
            f"dist.max_restarts={cfg.dist.max_restarts} hydra.run.dir=SHARED_DIR ...` on each node, or submit with -m hydra/launcher=submitit_slurm (docs/CLUSTER.md)"
        )


def stable_run_dir(run_dir: Path) -> Path:
    """Under torchrun a restarted rank 0 composes the config again, and `${now:...}` would name
    another folder: the first attempt's (its checkpoints, its MLflow run id, its metrics.jsonl) is
    kept in the elastic agent's store, which outlives restarts (src/distributed/env.py)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True" or "MASTER_ADDR" not in os.environ:
        return run_dir
    import datetime

    import torch.distributed as torch_dist

    store = torch_dist.TCPStore(os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=60))
    key = f"perflab/run_dir/{os.environ.get('TORCHELASTIC_RUN_ID', '')}"
    if store.check([key]):  # the store lives as long as torchrun: a key there is this run's
        return Path(store.get(key).decode())
    store.set(key, str(run_dir))
    return run_dir
