"""Step metrics written to MLflow from a separate process, so tracking never competes with training.

MLflow's own async logging runs in threads of the training process; on one H200 (2026-11-30,
`python -m src.bench.fsdp_vs_seed`) that cost 6-8% of mini_llm's tokens/s (89.7-91.7K with it
against 95.8-96.9K with tracking=none on 2 GPUs): its Python work holds the GIL that the
training loop needs to launch kernels. Here the training process writes one JSON line per logged
step into a pipe; `python -m src.tracking.writer URI RUN_ID` (a plain subprocess: it imports
MLflow and nothing of the training stack) drains the pipe on a reader thread, so the pipe never
fills, and stores whatever has queued up in one log_batch.
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
from pathlib import Path
from typing import Mapping

log = logging.getLogger(__name__)

_MAX_BATCH = 1000  # MLflow's limit on metrics per log_batch
FLUSH_INTERVAL_S = 2.0


class MetricWriter:
    """Hand step metrics to a writer process; `close()` waits until all of them are stored."""

    def __init__(self, uri: str, run_id: str, system_metrics_interval_s: float = 0.0):
        root = str(Path(__file__).resolve().parents[2])  # the folder holding the `src` package
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")])))
        self.process = subprocess.Popen(
            [sys.executable, "-m", "src.tracking.writer", uri, run_id, str(system_metrics_interval_s)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, bufsize=1, env=env,
        )
        # Wait until it has imported MLflow (1-3 s of CPU): paid before the first step, not
        # during the timed ones, where on a 2-core machine it would halve a CPU run's tokens/s.
        if self.process.stdout.readline().strip() != "ready":
            log.warning("MLflow metric writer failed to start; step metrics will not be logged")

    def log(self, step: int, metrics: Mapping[str, float | None]) -> None:
        values = {k: float(v) for k, v in metrics.items() if v is not None}
        try:
            self.process.stdin.write(json.dumps([step, int(time.time() * 1000), values]) + "\n")
        except (BrokenPipeError, ValueError):
            pass  # the writer died; close() reports it once, training goes on

    def close(self, timeout_s: float = 60.0) -> None:
        try:
            self.process.stdin.close()
        except BrokenPipeError:
            pass
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            log.warning("MLflow metric writer did not finish in %.0f s; stopping it", timeout_s)
            self.process.kill()
            return
        if code != 0:
            log.warning("MLflow metric writer exited with code %s; some step metrics may be missing", code)


def _read_lines(stream, q: queue.Queue) -> None:
    for line in stream:
        q.put(line)
    q.put(None)


def writer_main(uri: str, run_id: str, system_metrics_interval_s: float = 0.0) -> None:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    logging.getLogger("mlflow").setLevel(logging.WARNING)  # the monitor's start/stop notes would reach the run's console
    # Ctrl-C in a terminal signals the whole process group, this process too. Dying then would
    # drop what is queued (up to FLUSH_INTERVAL_S of steps, all of a short run's). Ignore it: the
    # training process closes the pipe when it stops, however it stops (SIGKILL included), and
    # this loop stores what is left, then exits: no orphan, no lost step, no traceback of ours.
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    # Background work: where the ranks use every core (a CPU run), the scheduler serves them first.
    os.nice(10)
    client = MlflowClient(tracking_uri=uri)
    monitor = None
    if system_metrics_interval_s > 0:
        # MLflow's own sampler (CPU, memory, disk, network; GPUs through pynvml) lives here too,
        # so its thread never competes with the training loop's.
        try:
            from mlflow.system_metrics.system_metrics_monitor import SystemMetricsMonitor

            monitor = SystemMetricsMonitor(run_id, sampling_interval=system_metrics_interval_s, tracking_uri=uri)
            _publish_sample(monitor)  # step 0 now: a run shorter than the interval still has a sample
            monitor.start()
        except Exception as err:  # psutil missing, no permission to read counters, ...
            print(f"system metrics off: {err}", file=sys.stderr)
            monitor = None
    print("ready", flush=True)
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=_read_lines, args=(sys.stdin, lines), daemon=True).start()
    done = False
    while not done:
        items = [lines.get()]
        # Gather for up to FLUSH_INTERVAL_S: one SQLite transaction every 2 s instead of one a step
        # keeps the writer's CPU use small where it shares cores with the ranks (a 2-core CPU run).
        deadline = time.monotonic() + FLUSH_INTERVAL_S
        while items[-1] is not None and len(items) < _MAX_BATCH:
            try:
                items.append(lines.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
        metrics = []
        for item in items:
            if item is None:
                done = True
                continue
            step, ts, values = json.loads(item)
            metrics.extend(Metric(k, v, ts, step) for k, v in values.items())
        for i in range(0, len(metrics), _MAX_BATCH):
            client.log_batch(run_id, metrics=metrics[i : i + _MAX_BATCH])
    if monitor is not None:
        _finish_with_sample(monitor)


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
    writer_main(sys.argv[1], sys.argv[2], float(sys.argv[3]) if len(sys.argv) > 3 else 0.0)
