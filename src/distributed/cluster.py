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

The launchers (hydra_plugins/perflab_submitit_launcher: Hydra takes plugins from that package
only) are the plugin's, but a job whose process died without a result (killed by the scheduler,
out of memory, a SIGKILL) is recorded FAILED, and the sweep goes on. Their settings, with nodes
and GPUs taken from dist.*, are in src/config.py.
"""
from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass
from pathlib import Path

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
