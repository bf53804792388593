"""What a task needs to know about the run beyond its config: where to write, how it was asked for."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RunContext:
    run_dir: str | None
    """the Hydra run (or sweep job) directory; rank 0 writes summary.json and logs there"""
    cwd: str
    """the directory the command was started in (relative paths, the sqlite store, git state)"""
    overrides: list[str] = field(default_factory=list)
    """the command-line overrides, for run names and tags"""
    tracking_uri: str = ""
    """the MLflow URI with relative sqlite paths made absolute"""
    parent_run_id: str | None = None
    """inside a Hydra multirun: the sweep's MLflow parent run"""
    sweep_keys: list[str] | None = None
    """inside a Hydra multirun: the keys the sweep varies, which name each job's run"""
