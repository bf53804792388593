"""Plugin: a real one-node SLURM cluster for the tests, the session's `slurm_cluster` fixture (at the
end). Debian's munged, slurmctld, slurmd and slurmdbd (slurm-wlm 22.05) on this machine, slurmdbd's
records in a private MariaDB, every file of theirs (config, key, sockets, state, spool, database,
logs) in one private folder, listening on free ports, so that it stands beside a system SLURM or
another test session's. Clients (sbatch, srun, squeue, scontrol, scancel, sinfo, sacct) find it
through SLURM_CONF.

The node is this machine as `slurmd -C` sees it (its CPUs, sockets, cores and RealMemory, under
its short hostname), reached at 127.0.0.1. slurmdbd is there because submitit learns that a job
ended from `sacct` (its result file aside): without accounting, a job that dies without a result
(a SIGKILL, the time limit) would never be seen to end.
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

import pytest

# what the fixture starts, and what submitit calls (sbatch to submit, sacct to watch, scontrol to
# requeue, scancel)
BINARIES = ("munged", "mariadb-install-db", "mariadbd", "slurmdbd", "slurmctld", "slurmd", "sacctmgr", "sbatch", "srun", "squeue",
            "scontrol", "scancel", "sinfo", "sacct")
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

    def finished(self, job_id: str, timeout: float = 60) -> dict[str, str]:
        """The job once SLURM has ended it. submitit returns as soon as the job's result pickle is
        written; the batch script's step still has to exit and slurmd report it, which under a loaded
        machine (2 cores running the suite) took seconds, so the job can still read RUNNING then."""
        deadline = time.monotonic() + timeout
        while True:
            job = self.job(job_id)
            if job.get("JobState") not in ("PENDING", "RUNNING", "COMPLETING") or time.monotonic() > deadline:
                return job
            time.sleep(0.5)

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


def _write_conf(base: Path, hostname: str, node_line: str, ports: dict[str, int]) -> Path:
    """slurm.conf and slurmdbd.conf (which slurmdbd reads from SLURM_CONF's folder)."""
    munge = f"AuthType=auth/munge\nAuthInfo=socket={base / 'run' / 'munge.socket'}"
    dbd = base / "slurmdbd.conf"
    dbd.write_text("\n".join([
        munge,
        "DbdHost=localhost",
        f"DbdPort={ports['slurmdbd']}",
        "SlurmUser=root",
        f"PidFile={base / 'run' / 'slurmdbd.pid'}",
        f"LogFile={base / 'log' / 'slurmdbd.log'}",
        "StorageType=accounting_storage/mysql",
        "StorageHost=127.0.0.1",
        f"StoragePort={ports['mariadbd']}",
        "StorageUser=root",
        "StorageLoc=slurm_acct_db",
        "",
    ]))
    dbd.chmod(0o600)  # slurmdbd refuses a config that others may read
    conf = base / "slurm.conf"
    conf.write_text("\n".join([
        "ClusterName=perflab-test",
        "SlurmctldHost=localhost",
        f"SlurmctldPort={ports['slurmctld']}",
        f"SlurmdPort={ports['slurmd']}",
        "SlurmUser=root",
        "SlurmdUser=root",
        "AuthType=auth/munge",
        "CredType=cred/munge",
        # cred_expire is also how long a requeued job waits before it may start again: 120 s by
        # default, 5 here (the least it takes) so a requeue test takes seconds
        f"AuthInfo=socket={base / 'run' / 'munge.socket'},cred_expire=5",
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
        # pending jobs tried every 2 s (60 s by default; a job is also tried when submitted): a
        # requeued job starts once its cred_expire has passed, not up to a minute later
        "SchedulerParameters=sched_interval=2",
        "SelectType=select/cons_tres",
        "SelectTypeParameters=CR_Core_Memory",
        # a job that names no memory gets 1 GB a CPU, not the whole node (which would run one job at a time)
        "DefMemPerCPU=1024",
        # jobs' states and exit codes to slurmdbd, for sacct; no sampling of their use
        "AccountingStorageType=accounting_storage/slurmdbd",
        "AccountingStorageHost=localhost",
        f"AccountingStoragePort={ports['slurmdbd']}",
        # the munge socket for talking to slurmdbd (AuthInfo's is not used there)
        f"AccountingStoragePass={base / 'run' / 'munge.socket'}",
        "JobAcctGatherType=jobacct_gather/none",
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
    """munged with a fresh key, a fresh MariaDB, slurmdbd, slurmctld and slurmd, each in the
    foreground in its own session (so it and its children stop with it), up once sinfo shows the
    node idle; at the end every job is cancelled and the daemons stopped. Raises RuntimeError, with
    the daemons' logs, if a daemon exits or the node is not idle within `wait_s`."""
    # /tmp, not pytest's tmp_path: munged refuses a socket folder that not everyone may enter, and
    # pytest's base folder is root's alone (0700)
    base = Path(tempfile.mkdtemp(prefix="perflab-slurm-"))
    base.chmod(0o755)
    for sub, mode in (("run", 0o755), ("key", 0o700), ("state", 0o700), ("spool", 0o755), ("log", 0o755), ("db", 0o700)):
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
    ports = {name: _free_port() for name in ("mariadbd", "slurmdbd", "slurmctld", "slurmd")}
    conf = _write_conf(base, hostname, node_line, ports)
    cluster = SlurmCluster(base, conf, hostname)
    done = subprocess.run([_sbin("mariadb-install-db"), "--no-defaults", f"--datadir={base / 'db'}", "--user=root", "--skip-test-db"],
                          capture_output=True, text=True, timeout=120)
    if done.returncode != 0:
        raise RuntimeError(f"mariadb-install-db failed:\n{done.stdout}{done.stderr}")
    # each daemon and what says it is ready for the next
    daemons = [
        ("munged", [_sbin("munged"), "--foreground", f"--socket={base / 'run' / 'munge.socket'}", f"--key-file={key}",
                    f"--log-file={base / 'log' / 'munged.log'}", f"--pid-file={base / 'run' / 'munged.pid'}",
                    f"--seed-file={base / 'key' / 'munged.seed'}"],
         lambda: (base / "run" / "munge.socket").exists()),
        # on loopback alone, and no accounts: slurmdbd connects as anyone; native AIO off, as
        # gVisor and some container kernels refuse io_submit
        ("mariadbd", [_sbin("mariadbd"), "--no-defaults", f"--datadir={base / 'db'}", "--user=root", "--bind-address=127.0.0.1",
                      f"--port={ports['mariadbd']}", f"--socket={base / 'run' / 'mariadb.sock'}", "--skip-grant-tables",
                      "--innodb-use-native-aio=0", f"--pid-file={base / 'run' / 'mariadbd.pid'}", f"--log-error={base / 'log' / 'mariadbd.log'}"],
         lambda: _listening(ports["mariadbd"])),
        ("slurmdbd", [_sbin("slurmdbd"), "-D"], lambda: cluster.run("sacctmgr", "-n", "list", "cluster").returncode == 0),
        ("slurmctld", [_sbin("slurmctld"), "-D", "-i", "-f", str(conf)], lambda: cluster.run("scontrol", "ping").returncode == 0),  # -i: no old state
        ("slurmd", [_sbin("slurmd"), "-D", "-f", str(conf)], lambda: cluster.run("sinfo", "-h", "-N", "-o", "%T").stdout.strip() == "idle"),
    ]
    env = {**os.environ, **cluster.env}
    try:
        for name, cmd, ready in daemons:
            with open(base / "log" / f"{name}.out.log", "w") as out:
                cluster.procs[name] = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True)
            _wait(ready, cluster, f"{name} ready", wait_s)
            if name == "slurmdbd":  # slurmctld registers with slurmdbd under a cluster that must exist
                done = cluster.run("sacctmgr", "-i", "add", "cluster", "perflab-test")
                if done.returncode != 0:
                    raise RuntimeError(f"sacctmgr add cluster failed: {done.stdout}{done.stderr}\n{cluster.logs()}")
        yield cluster
    finally:
        _stop(cluster)
        shutil.rmtree(base, ignore_errors=True)


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


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
    for name in reversed(list(cluster.procs)):  # the reverse of their start
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


@pytest.fixture(scope="session")
def slurm_cluster():
    """One real SLURM cluster for the session, this machine its one node: munged, slurmctld, slurmd
    and slurmdbd (on a MariaDB of its own), private to the session (running_cluster above).
    Yields a SlurmCluster; its `env` (SLURM_CONF) points sbatch and the other clients at it.
    Skipped only where the programs are missing: installed but broken, the tests fail."""
    missing = missing_binaries()
    if missing:
        if os.environ.get("CI") == "true":
            pytest.fail(f"SLURM is not installed ({', '.join(missing)} missing); .ci/run installs it (apt-get install slurm-wlm munge slurmdbd mariadb-server)")
        pytest.skip(f"SLURM is not installed ({', '.join(missing)} missing; apt-get install slurm-wlm munge slurmdbd mariadb-server); the SLURM tests need it")
    with running_cluster() as cluster:
        yield cluster
