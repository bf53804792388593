"""A real one-node SLURM cluster for the tests: Debian's munged, slurmctld and slurmd (slurm-wlm
22.05) on this machine, every file of theirs (config, key, sockets, state, spool, logs) in one
private folder, listening on free ports, so that it stands beside a system SLURM or another test
session's. Clients (sbatch, srun, squeue, scontrol, scancel, sinfo) find it through SLURM_CONF.

The node is this machine as `slurmd -C` sees it (its CPUs, sockets, cores and RealMemory, under
its short hostname), reached at 127.0.0.1. There is no slurmdbd: `sacct` answers "accounting
storage is disabled", which submitit's job watcher passes over, so a job is seen to end by its
result file alone (a job killed without one is never seen to end here).
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

# what the fixture starts and what submitit calls (sbatch to submit, scontrol to requeue, scancel)
BINARIES = ("munged", "slurmctld", "slurmd", "sbatch", "srun", "squeue", "scontrol", "scancel", "sinfo")
PARTITION = "debug"


def missing_binaries() -> list[str]:
    # munged and the daemons live in /usr/sbin, off a non-root PATH
    path = os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])
    return [name for name in BINARIES if shutil.which(name, path=path) is None]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _sbin(name: str) -> str:
    return shutil.which(name, path=os.pathsep.join([os.environ.get("PATH", ""), "/usr/sbin", "/sbin"])) or name


@dataclass
class SlurmCluster:
    base: Path
    conf: Path
    hostname: str
    partition: str = PARTITION
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)

    @property
    def env(self) -> dict[str, str]:
        """What a client process needs on top of os.environ: sbatch exports it into the job, so the
        job's srun, and submitit's `scontrol requeue` inside it, reach this cluster too."""
        return {"SLURM_CONF": str(self.conf)}

    def run(self, *cmd: str, timeout: float = 30) -> subprocess.CompletedProcess:
        """A SLURM client command against this cluster."""
        return subprocess.run(list(cmd), env={**os.environ, **self.env}, capture_output=True, text=True, timeout=timeout)

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job` as KEY: VALUE (JobState, Restarts, ExitCode, ...); {} once SLURM has forgotten it."""
        done = self.run("scontrol", "-o", "show", "job", job_id)
        if done.returncode != 0:
            return {}
        return dict(item.split("=", 1) for item in done.stdout.split() if "=" in item)

    def queue(self) -> list[str]:
        """Job ids in the queue (pending, running, completing)."""
        done = self.run("squeue", "-h", "-o", "%i")
        assert done.returncode == 0, done.stderr
        return done.stdout.split()

    def logs(self, tail: int = 4000) -> str:
        """The daemons' logs, each one's end: for a failing test's message."""
        parts = []
        for log in sorted((self.base / "log").glob("*.log")):
            parts.append(f"--- {log.name}\n{log.read_text(errors='replace')[-tail:]}")
        return "\n".join(parts)


def _write_conf(base: Path, hostname: str, node_line: str) -> Path:
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=perflab-test",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={_free_port()}",
        f"SlurmdPort={_free_port()}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire is also how long a requeued job waits before it may start again: 120 s by
        # default, 10 here so a requeue test takes seconds
        f"AuthInfo=socket={base / 'run' / 'munge.socket'},cred_expire=10",
        f"StateSaveLocation={base / 'state'}",
        f"SlurmdSpoolDir={base / 'spool'}",
        f"SlurmctldPidFile={base / 'run' / 'slurmctld.pid'}",
        f"SlurmdPidFile={base / 'run' / 'slurmd.pid'}",
        f"SlurmctldLogFile={base / 'log' / 'slurmctld.log'}",
        f"SlurmdLogFile={base / 'log' / 'slurmd.log'}",
        "SlurmctldDebug=info",
        "SlurmdDebug=info",
        # a job's processes found by their parent pids. proctrack/cgroup works too where cgroup v1's
        # freezer is writable, but names its groups /slurm_HOST/uid_U/job_N: two test sessions on
        # one machine, each counting jobs from 1, would share them
        "ProctrackType=proctrack/linuxproc",
        # each task bound to its CPUs (sched_setaffinity), as on a real cluster
        "TaskPlugin=task/affinity",
        "MpiDefault=none",
        "MailProg=/bin/true",  # slurmctld logs an error at start without one
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        # a job that names no memory gets 1 GB a CPU, not the whole node (which would run one job at a time)
        "DefMemPerCPU=1024",
        "JobAcctGatherType=jobacct_gather/none",
        "AccountingStorageType=accounting_storage/none",
        "JobCompType=jobcomp/none",
        "PreemptType=preempt/none",
        # SIGTERM, then SIGKILL 10 s later (30 s by default): a test's scancel ends within seconds
        "KillWait=10",
        "JobRequeue=1",
        "ReturnToService=2",
        f"{node_line} NodeAddr=127.0.0.1 State=UNKNOWN",
        f"PartitionName={PARTITION} Nodes={hostname} Default=YES MaxTime=INFINITE State=UP",
        "",
    ]))
    return conf


@contextmanager
def running_cluster(wait_s: float = 60) -> Iterator[SlurmCluster]:
    """munged with a fresh key, slurmctld and slurmd in the foreground (each in its own session, so
    they and their children stop with them), up once sinfo shows the node idle; at the end every
    job is cancelled and the daemons stopped. Raises RuntimeError, with the daemons' logs, if the
    node is not idle within `wait_s`."""
    # /tmp, not pytest's tmp_path: munged refuses a socket folder that not everyone may enter, and
    # pytest's base folder is root's alone (0700)
    base = Path(tempfile.mkdtemp(prefix="perflab-slurm-"))
    base.chmod(0o755)
    for sub, mode in (("run", 0o755), ("key", 0o700), ("state", 0o700), ("spool", 0o755), ("log", 0o755)):
        (base / sub).mkdir(mode=mode)
        (base / sub).chmod(mode)
    key = base / "key" / "munge.key"
    key.write_bytes(os.urandom(1024))
    key.chmod(0o400)
    # the node exactly as slurmd sees this machine, or slurmd would drain it ("Low RealMemory")
    probe = subprocess.run([_sbin("slurmd"), "-C"], capture_output=True, text=True, timeout=30)
    if probe.returncode != 0 or not probe.stdout.startswith("NodeName="):
        raise RuntimeError(f"slurmd -C failed: {probe.stdout}{probe.stderr}")
    node_line = probe.stdout.splitlines()[0].strip()
    hostname = node_line.split()[0].split("=", 1)[1]
    conf = _write_conf(base, hostname, node_line)
    cluster = SlurmCluster(base, conf, hostname)
    env = {**os.environ, **cluster.env}
    daemons = {
        "munged": [_sbin("munged"), "--foreground", f"--socket={base / 'run' / 'munge.socket'}", f"--key-file={key}",
                   f"--log-file={base / 'log' / 'munged.log'}", f"--pid-file={base / 'run' / 'munged.pid'}",
                   f"--seed-file={base / 'key' / 'munged.seed'}"],
        "slurmctld": [_sbin("slurmctld"), "-D", "-i", "-f", str(conf)],  # -i: no old state to recover
        "slurmd": [_sbin("slurmd"), "-D", "-f", str(conf)],
    }
    try:
        for name, cmd in daemons.items():
            with open(base / "log" / f"{name}.out.log", "w") as out:
                cluster.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            if name == "munged":
                _wait(lambda: (base / "run" / "munge.socket").exists(), cluster, "munged's socket", 30)
        _wait(lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle", cluster, "the node idle in sinfo", wait_s)
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(base, ignore_errors=True)


def _wait(ready, cluster: SlurmCluster, what: str, wait_s: float) -> None:
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline:
        dead = [name for name, proc in cluster.procs.items() if proc.poll() is not None]
        if dead:
            raise RuntimeError(f"{', '.join(dead)} exited while waiting for {what}:\n{cluster.logs()}")
        try:
            if ready():
                return
        except subprocess.TimeoutExpired:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"no {what} after {wait_s:.0f} s:\n{cluster.logs()}")


def _stop(cluster: SlurmCluster) -> None:
    if cluster.procs.get("slurmctld") and cluster.procs["slurmctld"].poll() is None:
        cluster.run("scancel", f"--partition={cluster.partition}")
        # the jobs' steps end within KillWait (10 s) of their SIGTERM; 30 s covers a slow epilog
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and cluster.run("squeue", "-h", "-o", "%i").stdout.strip():
            time.sleep(0.5)
    for name in ("slurmd", "slurmctld", "munged"):  # the reverse of their start
        proc = cluster.procs.get(name)
        if proc is None or proc.poll() is not None:
            continue
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
        except ProcessLookupError:
            pass
