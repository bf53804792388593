"""kernels=auto's timings kept between runs, outside any run folder: a second run of the same key
reuses them instead of timing every candidate again (the choice follows from the timings).

The key has two halves. The run's half is what the timings measure: the model's shape, the batch and
sequence, the precision, the optimizer, the speed and compile settings, the world size and the ops
timed. The machine's half is what they were measured with: the GPU's name, torch's and Triton's
versions and a hash of the code that makes and times the candidates (kernels/, src/fusion/,
src/models/). A file is RUN_HASH/MACHINE_HASH.json under the cache folder ($PERFLAB_CACHE_DIR, else
$XDG_CACHE_HOME/perflab, else ~/.cache/perflab); where the run's half matches a file of another
machine's half, the log says which of them differs.
"""
from __future__ import annotations

import datetime as dt
import hashlib
import json
import os
import subprocess
from dataclasses import asdict, dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.runtime import installed_version

ROOT = Path(__file__).resolve().parents[2]
CODE = ("kernels/triton", "src/fusion", "src/models")
"""the folders whose source decides what a candidate is and how it is timed"""
# the settings of kernels.* that are auto's outputs or where its inputs come from, not what is timed
NOT_TIMED = {"fused", "compiled", "diagnosis", "auto"}


def cache_dir() -> Path:
    if os.environ.get("PERFLAB_CACHE_DIR"):
        return Path(os.environ["PERFLAB_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "perflab"


def gpu_name() -> str:
    """The name of the GPU the timings run on (CUDA's device 0), through NVML: no CUDA context in
    the launcher. Empty where NVML cannot tell (nothing is cached then)."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", "0").split(",")[0].strip() or "0"
    try:
        import pynvml as nvml

        nvml.nvmlInit()
        handle = nvml.nvmlDeviceGetHandleByUUID(first) if first.startswith(("GPU-", "MIG-")) else nvml.nvmlDeviceGetHandleByIndex(int(first))
        name = nvml.nvmlDeviceGetName(handle)
        return name.decode() if isinstance(name, bytes) else str(name)
    except Exception:  # no binding, no driver, a CUDA_VISIBLE_DEVICES NVML does not read: nvidia-smi's view
        pass
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader", "-i", first], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return ""
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else ""


def code_hash() -> str:
    digest = hashlib.sha256()
    for path in sorted(p for folder in CODE for p in (ROOT / folder).rglob("*.py")):
        digest.update(path.relative_to(ROOT).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()[:16]


def machine(gpu: str | None = None) -> dict:
    import torch

    return {"gpu": gpu_name() if gpu is None else gpu, "torch": torch.__version__, "triton": installed_version("triton"), "code": code_hash()}


def run_key(cfg: DictConfig, ops: list[str]) -> dict:
    """What the timings depend on in the run's config (the model's name and weights' folder do not)."""
    def section(node: DictConfig, drop: set[str]) -> dict:
        return {k: v for k, v in OmegaConf.to_container(node, resolve=True, enum_to_str=True).items() if k not in drop}

    return {
        "model": section(cfg.model, {"name", "hf_path"}), "precision": section(cfg.precision, {"name"}),
        "optim": section(cfg.optim, set()), "speed": section(cfg.speed, {"name"}), "kernels": section(cfg.kernels, {"name"} | NOT_TIMED),
        "batch_size": cfg.data.batch_size, "seq_len": cfg.data.seq_len, "loss_fp32": cfg.train.loss_fp32,
        "log_every": cfg.train.log_every, "world_size": cfg.dist.nproc * cfg.dist.nnodes, "ops": sorted(ops),
    }


def _hash(obj: dict) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True).encode()).hexdigest()[:20]


class CacheRefused(ValueError):
    """A cache file that cannot be reused; the message names it and why."""


@dataclass
class Cached:
    timings: list[dict]
    """the OpTimings, as asdict gives them"""
    path: Path
    measured_at: str
    """UTC, to the minute"""


class AutoCache:
    def __init__(self, run: dict, machine: dict, root: Path | None = None):
        self.run, self.machine = run, machine
        self.folder = (root or cache_dir()) / "kernels_auto" / _hash(run)
        self.path = self.folder / f"{_hash(machine)}.json"

    @classmethod
    def for_run(cls, cfg: DictConfig, ops: list[str]) -> AutoCache | None:
        """The cache entry of this run on this machine; None where the GPU cannot be named."""
        here = machine()
        return cls(run_key(cfg, ops), here) if here["gpu"] else None

    def lookup(self) -> Cached | None:
        """This run's timings on this machine; None where there are none yet. A file that is cut
        off, not a timing record, or another key's raises CacheRefused naming it (then it is timed
        again and written whole)."""
        if not self.path.is_file():
            return None
        try:
            record = json.loads(self.path.read_text())
            timings, measured_at = record["timings"], record["measured_at"]
            if not isinstance(timings, list) or not all(isinstance(t, dict) and "op" in t for t in timings):
                raise ValueError("its timings are not a list of op timings")
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise CacheRefused(f"{self.path} is cut off or not a timing record ({type(err).__name__}: {err})") from None
        if record.get("run") != self.run or record.get("machine") != self.machine:
            raise CacheRefused(f"{self.path} holds the timings of another run or machine than its name says")
        return Cached(timings, self.path, measured_at)

    def differs(self) -> str | None:
        """Where the run was timed before on another machine half: what differs, in words (the newest such file)."""
        others = sorted((p for p in self.folder.glob("*.json") if p != self.path), key=lambda p: p.stat().st_mtime)
        for path in reversed(others):
            try:
                before = json.loads(path.read_text())["machine"]
            except (OSError, ValueError, KeyError):
                continue
            changed = [f"{k} {before.get(k) or '?'} -> {v or '?'}" if k != "code" else "the kernels' or models' code"
                       for k, v in self.machine.items() if before.get(k) != v]
            return f"{', '.join(changed)} since {path}"
        return None

    def store(self, timings: list) -> Path:
        """Write the timings (OpTimings) whole: a temporary file renamed into place."""
        self.folder.mkdir(parents=True, exist_ok=True)
        record = {"run": self.run, "machine": self.machine, "measured_at": dt.datetime.now(dt.UTC).strftime("%Y-%m-%d %H:%M UTC"),
                  "timings": [asdict(t) if not isinstance(t, dict) else t for t in timings]}
        tmp = self.path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(record, indent=1))
        tmp.replace(self.path)
        return self.path
