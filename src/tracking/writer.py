"""Step metrics written to MLflow from a separate process, so tracking never competes with training.

MLflow's own async logging runs in threads of the training process, where it cost several percent
of mini_llm's tokens/s against tracking=none (benchmarks/tracking_overhead.py measures it): its
Python work holds the GIL that the training loop needs to launch kernels. Here the training process writes one JSON line per logged
step into a pipe; `python -m src.tracking.writer URI RUN_ID` (a plain subprocess: it imports
MLflow and nothing of the training stack) drains the pipe on a reader thread, so the pipe never
fills, and stores whatever has queued up in one log_batch. Started with RUN_ID `-`, it imports
MLflow while rank 0 opens the run, reads the id as its first line of input, then opens the store.

A tracking server that stops answering (a restart, a network cut) loses no metric: a batch that
could not be stored stays pending and is sent again, with backoff, together with what queued up
meanwhile; MLflow's SQL store skips a metric it already holds, so a batch stored by a request whose
answer was lost is not doubled. MLflow's own HTTP retries (7, backing off to minutes) are turned off
in this process so that this loop decides; after training ends it keeps trying for `retry_s`, then
exits EXIT_METRICS_NOT_STORED. The run's metrics.jsonl, written by the training process, keeps
every step either way, and `python -m src.tracking.sync RUN_DIR` stores the rest later.
"""
from __future__ import annotations

import json
import logging
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path

log = logging.getLogger(__name__)

_MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch
FLUSH_INTERVAL_S = 2.0
# Backoff between attempts at a server that does not answer: 0.5 s doubling to 5 s. `mlflow server`
# takes about 5 s to answer /health again after a restart on 2 busy cores, so a restarted server
# gets the pending steps within 5 s of coming back, and a dead one costs one request every 5 s.
RETRY_FIRST_S, RETRY_MAX_S = 0.5, 5.0
# One request's timeout in the writer: MLflow's default (120 s) would hold a batch that long.
REQUEST_TIMEOUT_S = 10
EXIT_METRICS_NOT_STORED = 3
RUN_ID_LATER = "-"  # the run id comes as the first line of input (MetricWriter.begin)


class MetricWriter:
    """Hand step metrics to a writer process; `close()` waits until all of them are stored."""

    def __init__(self, uri: str, system_metrics_interval_s: float = 0.0, retry_s: float = 60.0):
        """Start the writer process: it imports MLflow while the caller opens the run, and waits for
        begin(run_id). In turn, the two imports took about 4 s of a tracked run's start on an idle
        2-core machine; side by side about 2."""
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the `src` package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        # this process retries itself (module docstring): one attempt per request, bounded
        env.update(MLFLOW_HTTP_REQUEST_MAX_RETRIES="0", MLFLOW_HTTP_REQUEST_TIMEOUT=str(REQUEST_TIMEOUT_S))
        self.retry_s = retry_s
        self.process = subprocess.Popen(
            [sys.executable, "-m", "src.tracking.writer", uri, RUN_ID_LATER, str(system_metrics_interval_s), str(retry_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
        )

    def begin(self, run_id: str) -> None:
        """Name the run, and wait until the writer is ready: it has imported MLflow (1-3 s of CPU),
        paid before the first step, not during the timed ones, where on a 2-core machine it would
        halve a CPU run's tokens/s."""
        try:
            self.process.stdin.write(run_id + "\n")
        except (BrokenPipeError, ValueError):
            pass  # it died; the missing "ready" says so
        if self.process.stdout.readline().strip() != "ready":
            log.warning("MLflow metric writer failed to start; step metrics will not be logged")

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        try:
            self.process.stdin.write(json.dumps([step, int(time.time() * 1000), values]) + "\n")
        except (BrokenPipeError, ValueError):
            pass  # the writer died; close() reports it once, training goes on

    def close(self, timeout_s: float | None = None) -> bool:
        """Wait for the writer to store what it holds: up to its retry window against a server
        that stopped answering, plus the time one last request and the system-metrics sample take.
        False when some step metrics may not be stored (metrics.jsonl has them all)."""
        timeout_s = self.retry_s + 2 * REQUEST_TIMEOUT_S + 30 if timeout_s is None else timeout_s
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("MLflow metric writer did not finish in %.0f s; stopping it (metrics.jsonl keeps every step)", timeout_s)
            self.process.kill()
            return False
        if code not in (0, EXIT_METRICS_NOT_STORED):
            log.warning("MLflow metric writer exited with code %s; some step metrics may be missing (metrics.jsonl keeps every step)", code)
        return code == 0


def _read_lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


class PendingMetrics:
    """Metrics not yet stored, sent again with backoff while the server does not answer."""

    def __init__(self, client, run_id: str, uri: str):
        self.client, self.run_id, self.uri = client, run_id, uri
        self.metrics: list = []
        self.failing_since: float | None = None
        self.delay_s = 0.0

    def store(self) -> bool:
        """Try to store everything pending; True when nothing is left."""
        while self.metrics:
            batch = self.metrics[:_MAX_BATCH]
            try:
                self.client.log_batch(self.run_id, metrics=batch)
            except Exception as err:  # connection refused, timeout, 5xx: all worth another try
                if self.failing_since is None:
                    self.failing_since = time.monotonic()
                    _say(f"MLflow server at {self.uri} did not take step metrics ({_reason(err)}); retrying every "
                         f"{RETRY_MAX_S:.0f} s at most, metrics.jsonl keeps every step")
                self.delay_s = min(max(2 * self.delay_s, RETRY_FIRST_S), RETRY_MAX_S)
                return False
            del self.metrics[: len(batch)]
        if self.failing_since is not None:
            _say(f"MLflow server at {self.uri} answers again after {time.monotonic() - self.failing_since:.0f} s; the pending step metrics are stored")
            self.failing_since = None
        self.delay_s = 0.0
        return True

    def describe(self) -> str:
        steps = sorted({m.step for m in self.metrics})
        return f"{len(self.metrics)} values of steps {steps[0]}-{steps[-1]}" if steps else "nothing"


def _reason(err: Exception) -> str:
    text = str(err)
    for marker in ("Connection refused", "Read timed out", "Max retries exceeded", "Connection reset", "Connection aborted"):
        if marker in text:
            return marker.lower()
    return type(err).__name__ + (f": {text.splitlines()[0][:200]}" if text else "")


def _say(message: str) -> None:
    print(f"[{time.strftime('%Y-%m-%d %H:%M:%S')}][src.tracking.writer][WARNING] - {message}", file=sys.stderr, flush=True)


def writer_main(uri: str, run_id: str, system_metrics_interval_s: float = 0.0, retry_s: float = 60.0) -> int:
    from mlflow.entities import Metric

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # the monitor's start/stop notes would reach the run's console
    # Ctrl-C in a terminal signals the whole process group, this process too. Dying then would
    # drop what is queued (up to FLUSH_INTERVAL_S of steps, all of a short run's). Ignore it: the
    # training process closes the pipe when it stops, however it stops (SIGKILL included), and
    # this loop stores what is left, then exits: no orphan, no lost step, no traceback of ours.
    # The stop signals (SIGTERM at a SLURM preemption, to the whole process group; SIGUSR1/2 ahead
    # of a time limit) likewise: the ranks save and close the pipe, and every step gets stored.
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGHUP):
        signal.signal(sig, signal.SIG_IGN)

    from mlflow.store.db.db_types import DATABASE_ENGINES

    from src.tracking.mlflow_run import client_for

    if run_id == RUN_ID_LATER:
        if uri.split(":", 1)[0].split("+", 1)[0] in DATABASE_ENGINES:
            # the SQL store's modules (SQLAlchemy, alembic: about 2 s of CPU) load while rank 0 opens
            # the run; the store itself is opened after, when the run and so its tables exist (a new
            # PostgreSQL database has no lock of ours to make them under)
            import mlflow.store.tracking.sqlalchemy_store  # noqa: F401
        run_id = sys.stdin.readline().strip()
        if not run_id:  # the training process never opened its run (and closed the pipe)
            return 0
    client = client_for(uri)
    # Background work: where the ranks use every core (a CPU run), the scheduler serves them first.
    os.nice(10)
    monitor = None
    if system_metrics_interval_s > 0:
        # MLflow's own sampler (CPU, memory, disk, network; GPUs through pynvml) lives here too,
        # so its thread never competes with the training loop's.
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=system_metrics_interval_s, tracking_uri=uri)
            _publish_sample(monitor)  # step 0 now: a run shorter than the interval still has a sample
            monitor.start()
        except Exception as err:  # psutil missing, no permission to read counters, a server gone
            print(f"system metrics off: {err}", file=sys.stderr)
            monitor = None
    print("ready", flush=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(sys.stdin, lines), daemon=True).start()
    pending = PendingMetrics(client, run_id, uri)
    done = False
    while not done:
        # Gather for up to FLUSH_INTERVAL_S (or the backoff delay while the server does not
        # answer): one SQLite transaction every 2 s instead of one a step keeps the writer's CPU
        # use small where it shares cores with the ranks (a 2-core CPU run).
        deadline = time.monotonic() + max(FLUSH_INTERVAL_S, pending.delay_s)
        items = [lines.get()] if not pending.metrics else []  # idle: block until the next step comes
        while not items or items[-1] is not None:
            try:
                items.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        for item in items:
            if item is None:
                done = True
                continue
            step, ts, values = json.loads(item)
            pending.metrics.extend(Metric(k, v, ts, step) for k, v in values.items())
        pending.store()
    # The pipe is closed (training ended): what is still pending gets retry_s more.
    give_up = time.monotonic() + retry_s
    while not pending.store() and time.monotonic() < give_up:
        time.sleep(min(pending.delay_s, max(0.0, give_up - time.monotonic())))
    if monitor is not None:
        try:
            _finish_with_sample(monitor)
        except Exception as err:
            print(f"system metrics: the last sample was not stored ({_reason(err)})", file=sys.stderr)
    if pending.metrics:  # the training process says so, with the command that stores them later
        return EXIT_METRICS_NOT_STORED
    return 0


def _publish_sample(monitor) -> None:
    """One sample of every system metric, logged at once (MLflow's monitor logs only after its
    first interval, 10 s by default: a 5 s run had no system metrics at all)."""
    monitor.collect_metrics()
    monitor.publish_metrics(monitor.aggregate_metrics())


def _finish_with_sample(monitor) -> None:
    """Stop the sampler, then log a last sample: its loop drops what it gathered since its last
    publish when told to stop, so the run's end would otherwise not show."""
    monitor._shutdown_event.set()
    if monitor._process is not None:
        monitor._process.join()
    try:
        _publish_sample(monitor)
    finally:
        monitor.mlflow_logger.flush()


if __name__ == "__main__":
    sys.exit(writer_main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0, float(sys.argv[4]) if len(sys.argv) > 4 else 60.0))
