"""Settings that compose but cannot run: checked before any rank, run directory or MLflow run exists.

Each check raises ConfigError with one line: the bad value, then the fix. This module keeps the
rules across groups (unknown keys, the tracking store, which backend runs which task on which
devices); each task's own checks live beside it: src/train/checks.py, src/edge/checks.py,
src/kernel_bench/checks.py, src/diagnose/checks.py.
"""
from __future__ import annotations

import copy
import os
import re
from dataclasses import MISSING, fields, is_dataclass
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

from src.config import GROUPS, RunConfig
from src.config.compose import ConfigError
from src.runtime import world_size

TRAINING_BACKENDS = {"cpu", "cuda", "mps"}


def _check_group_keys(cfg: DictConfig) -> None:
    # `+model.dimm=3` (or `+foo=1`, `+optim.lr_max=1`) appends a key that no schema knows; it would
    # surface much later as a constructor error, or be ignored without a word, so refuse it here.
    top = {f.name for f in fields(RunConfig)}
    extra = sorted(set(cfg.keys()) - top - {"hydra"})
    if extra:
        raise ConfigError(f"{extra[0]}: unknown top-level key; valid ones: {', '.join(sorted(top - {'extra'}))} (free-form tags go in +extra.NAME=VALUE)")
    sections = {f.name: f.default_factory() for f in fields(RunConfig) if is_dataclass(f.default_factory if f.default_factory is not MISSING else None)}
    sections.update({group: schema for group, schema in GROUPS.items()})
    model_schema = OmegaConf.get_type(cfg.model)  # the architecture's own, a subclass of ModelConfig
    if model_schema is not None and issubclass(model_schema, GROUPS["model"]):
        sections["model"] = model_schema
    for section, schema in sections.items():
        known = {f.name for f in fields(schema)}
        extra = sorted(set(cfg[section].keys()) - known)
        if extra:
            raise ConfigError(f"{section}.{extra[0]}: unknown key in {section}; valid keys: {', '.join(sorted(known - {'name'}))}")


def _check_tracking_uri(cfg: DictConfig) -> None:
    """A sqlite store in a folder that does not exist: MLflow would create the folder (anywhere,
    `/nonexistent_dir/` at the filesystem root included) without a word."""
    uri = cfg.tracking.uri
    if not cfg.tracking.enabled:
        return
    if uri.startswith("sqlite:///"):
        db = Path(uri[len("sqlite:///"):])
        folder = (db if db.is_absolute() else Path(os.getcwd()) / db).parent
        if not folder.is_dir():
            raise ConfigError(f"tracking.uri={uri}: no folder {folder} for the database; create it first, or use tracking.uri=sqlite:///mlflow.db (here)")
        if not os.access(folder, os.W_OK):
            raise ConfigError(f"tracking.uri={uri}: cannot write in {folder}; use tracking.uri=sqlite:///mlflow.db (here) or a writable folder")
    elif not uri.startswith(("http://", "https://", "databricks", "postgresql", "mysql", "mssql")):
        raise ConfigError(f"tracking.uri={uri}: MLflow 3 takes a database or a server here: sqlite:///mlflow.db, or http://HOST:PORT of `mlflow server`")


def _check_rdzv_endpoint(cfg: DictConfig) -> None:
    """HOST[:PORT] as torch's elastic agent reads it (parse_rendezvous_endpoint in
    torch/distributed/elastic/rendezvous/utils.py), which raises a ValueError inside the launch,
    after the run's folder and MLflow run exist. No port: torch's 29400."""
    endpoint = str(cfg.dist.rdzv_endpoint).strip()
    if not endpoint:
        return
    given = f"dist.rdzv_endpoint={cfg.dist.rdzv_endpoint}"
    example = "e.g. dist.rdzv_endpoint=node0:29400 (the first node's address)"
    if endpoint.startswith("[") and endpoint.endswith("]"):  # a bracketed IPv6 address alone
        host, port = endpoint[1:-1], None
    else:
        host, _, port = endpoint.rpartition(":") if ":" in endpoint else (endpoint, "", None)
        host = host[1:-1] if host.startswith("[") and host.endswith("]") else host
    if port is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port) or int(port) > 65535:
            raise ConfigError(f"{given}: the port must be a number from 1 to 65535, not '{port}'; use HOST:PORT, {example}")
        if int(port) == 0 and cfg.dist.nnodes > 1:
            raise ConfigError(f"{given}: port 0 lets the first node bind any free port, which the other {cfg.dist.nnodes - 1} node(s) cannot know; "
                              f"name a free port, {example}")
    if not re.fullmatch(r"[\w.:-]+", host):
        raise ConfigError(f"{given}: '{host}' is not a host name or IP address; use HOST:PORT with no scheme or path, {example}")


def _check_iree_target(cfg: DictConfig) -> None:
    """A Vulkan target the installed IREE compiler cannot resolve crashes it (SIGSEGV) mid-run
    (src/edge/iree_targets.py); check_infer has passed the name on its pattern alone."""
    from src.edge.iree_targets import compiler_version, known_names, resolves
    from src.edge.task import default_target

    target = default_target("vulkan", cfg.edge.target)
    if resolves(target) is False:
        raise ConfigError(f"edge.target={target}: the installed IREE compiler ({compiler_version()}) knows no Vulkan target of that name "
                          f"and would crash compiling for it; use one it knows: {', '.join(known_names())}")


def _check_fake(cfg: DictConfig, as_worker: bool) -> None:
    """dist.fake runs rank 0 of the group alone: nothing that needs the other ranks to exist."""
    world = world_size(cfg)
    if world < 2:
        raise ConfigError(f"dist.fake=true fakes a group of dist.nproc x dist.nnodes ranks, here {world}; set dist.nproc=2 or more (the GPUs the run is meant for)")
    if as_worker:
        raise ConfigError("dist.fake=true runs the group's rank 0 alone in this process; start it with `python -m src.run`, not torchrun or srun")
    if cfg.sharding.strategy not in ("fsdp2", "hsdp"):
        # DDP's reducer reads a tensor back from each all-reduce's future, and a faked one returns none
        raise ConfigError(f"dist.fake=true fakes FSDP2's group, and sharding={cfg.sharding.name} replicates the model with DDP, whose gradient "
                          "all-reduce needs a real group; use sharding=fsdp2 or hsdp")
    ck = cfg.checkpoint
    if ck.enabled or ck.resume not in ("auto", "none") or ck.export_safetensors:
        raise ConfigError("dist.fake=true: rank 0 alone holds 1/N of the weights, so it can neither write a whole checkpoint (nor model.safetensors) "
                          "nor load one; set checkpoint.enabled=false checkpoint.resume=none checkpoint.export_safetensors=false")
    if cfg.fault.kind != "none" and cfg.fault.rank != 0:
        raise ConfigError(f"fault.rank={cfg.fault.rank} never runs under dist.fake=true (rank 0 alone); set fault.rank=0")


def _check_memory(cfg: DictConfig, as_worker: bool, capacity: tuple[int, str] | None) -> None:
    """A run whose tensors cannot fit (src/memory_estimate.py) fails minutes later in a rank, or
    swaps the host to a standstill: refused against the GPU's memory (no GPU visible, as on a login
    node: not checked) or, on CPU, the host's available memory for all of this node's ranks.
    `capacity`: (bytes, what they are), else probed. Under torchrun the ranks already run."""
    from src.memory_estimate import estimate, gpu_capacity, host_available_bytes, human_bytes

    backend = cfg.backend.name
    if as_worker or backend not in ("cpu", "cuda"):  # MPS shares the host's memory in ways not modelled here
        return
    ranks = 1 if backend == "cuda" or cfg.dist.fake else cfg.dist.nproc  # a GPU holds one rank; a CPU host this node's
    if capacity is None:
        if backend == "cuda":
            found = gpu_capacity(1 if cfg.dist.fake else cfg.dist.nproc)
            capacity = found and (found[0], f"the GPU ({found[1]}) has {human_bytes(found[0])}")
        else:
            available = host_available_bytes()
            capacity = available and (available, f"this host has {human_bytes(available)} available")
        if not capacity:
            return
    try:
        est = estimate(cfg)
    except Exception:  # a model its constructor refuses past its architecture's checks: the rank says so in its own words
        return
    need = est.peak * ranks
    if need <= capacity[0]:
        return
    layers = _layers_that_fit(cfg, capacity[0] / ranks)
    fixes = [f"model.n_layers={layers}" if layers else f"a narrower model (model.n_layers=1 does not fit at model.dim={cfg.model.dim})"]
    if cfg.sharding.strategy == "none":
        fixes.append("sharding=fsdp2 over more ranks (sharding=none copies everything to each)")
    else:
        fixes.append("more GPUs (dist.nproc, dist.nnodes)" if backend == "cuda" else "more hosts (dist.nnodes; this host's ranks share its memory)")
    if cfg.ac.mode != "full":
        fixes.append("ac.mode=full")
    if cfg.data.batch_size > 1:
        fixes.append(f"a data.batch_size below {cfg.data.batch_size}")
    needs = f"{human_bytes(need)}: {ranks} ranks x {est.summary()}" if ranks > 1 else est.summary()
    raise ConfigError(f"the run needs about {needs}, and {capacity[1]}; "
                      f"use {', '.join(fixes[:-1])} or {fixes[-1]}")


def _layers_that_fit(cfg: DictConfig, budget: float) -> int:
    """The most blocks (fewer than model.n_layers) whose estimate fits `budget` bytes a rank; 0: not even one."""
    from src.memory_estimate import estimate

    trial = copy.deepcopy(cfg)
    lo, hi = 0, cfg.model.n_layers - 1
    while lo < hi:  # the estimate grows with the blocks: a bisection, a meta-device model each step
        mid = (lo + hi + 1) // 2
        trial.model.n_layers = mid
        if estimate(trial).peak <= budget:
            lo = mid
        else:
            hi = mid - 1
    return lo


def _preset_sets(cfg: DictConfig, group: str) -> bool:
    """Whether the +exp preset's defaults list picks `group` (`- override /backend: cuda`): a refusal
    of that setting then names the preset, which the user typed, not the setting, which they did not."""
    import yaml

    folder = Path(__file__).resolve().parents[2] / "conf" / "exp"
    name, seen = cfg.get("exp"), set()
    while name and name not in seen and (folder / f"{name}.yaml").exists():  # a preset on top of another (fsdp4_fp8 <- fsdp4_tuned <- fsdp4)
        seen.add(name)
        defaults = (yaml.safe_load((folder / f"{name}.yaml").read_text()) or {}).get("defaults") or []
        if any(isinstance(d, dict) and f"override /{group}" in d for d in defaults):
            return True
        name = next((d for d in defaults if isinstance(d, str) and d != "_self_"), None)
    return False


def validate(cfg: DictConfig, cuda_device_count: int | None = None, mps_available: bool | None = None, as_worker: bool = False,
             cuda_capability: tuple[tuple[int, int] | None, str] | None = None, memory: tuple[int, str] | None = None) -> None:
    """Raise ConfigError for the first impossible combination. Device facts are probed unless given
    (tests pass them to check the messages for hardware this machine lacks): `cuda_capability` is
    (the lowest compute capability of the visible GPUs, that GPU's name); `memory` the bytes a rank
    may use on its device (a GPU's, or this host's for all its CPU ranks) and what they are."""
    import torch  # here, not at the top: the rest of src/config imports no torch, for `--help`

    from src.train.checks import TRAINING_TASKS, check_training

    _check_group_keys(cfg)
    _check_tracking_uri(cfg)
    backend, task, sharding = cfg.backend.name, cfg.task.name, cfg.sharding
    nproc = cfg.dist.nproc
    if cuda_device_count is None:
        cuda_device_count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if mps_available is None:
        mps_available = torch.backends.mps.is_available()

    if cfg.dist.fake and task not in TRAINING_TASKS:  # before the one-process tasks' own checks, which return
        raise ConfigError(f"dist.fake=true fakes a training run's group, and task={task} runs in one process already; drop dist.fake")
    if task in TRAINING_TASKS and backend not in TRAINING_BACKENDS:
        raise ConfigError(f"backend={backend} cannot train; use it with task=infer (+exp=edge), or train with backend=cpu or backend=cuda")
    if task == "infer":  # one process, one device: none of the training checks apply
        from src.edge.checks import check_infer

        check_infer(cfg, backend, cuda_device_count, mps_available)
        if backend == "vulkan" and cfg.edge.action != "run":
            _check_iree_target(cfg)
        return
    if task == "kernel_bench":  # one process, one device: none of the training checks apply
        from src.kernel_bench.checks import check_kernel_bench

        check_kernel_bench(cfg, backend, cuda_device_count)
        return
    if task == "diagnose":
        from src.diagnose.checks import check_diagnose

        if check_diagnose(cfg, backend, cuda_device_count):  # diagnosing a report runs nothing on a device
            return
    if cfg.profile.nvtx and backend != "cuda":
        raise ConfigError(f"profile.nvtx=true marks ranges for Nsight tools on an NVIDIA GPU; with backend={backend} use +exp=profile (torch.profiler)")
    if backend == "cuda" and cuda_device_count == 0:
        if _preset_sets(cfg, "backend"):
            raise ConfigError(f"+exp={cfg.exp} is a GPU preset (it sets backend=cuda) and no CUDA GPU is visible (torch.cuda.is_available() is False); "
                              "run it on a machine with an NVIDIA GPU; on this one `python -m src.run` (the defaults) trains on the CPU")
        raise ConfigError("backend=cuda but no CUDA GPU is visible (torch.cuda.is_available() is False); use backend=cpu, or run on a machine with an NVIDIA GPU")
    if backend == "mps" and not mps_available:
        raise ConfigError("backend=mps but torch.backends.mps.is_available() is False (MPS needs Apple Silicon and macOS 12.3+); use backend=cpu")
    if task in TRAINING_TASKS and backend == "mps" and (sharding.strategy != "none" or nproc != 1):
        raise ConfigError(f"backend=mps trains on one device only (sharding={sharding.name}, dist.nproc={nproc}); use sharding=none dist.nproc=1")
    if nproc < 1 or cfg.dist.nnodes < 1:
        raise ConfigError(f"dist.nproc={nproc} dist.nnodes={cfg.dist.nnodes}: both must be at least 1")
    _check_rdzv_endpoint(cfg)
    if cfg.dist.fake:
        _check_fake(cfg, as_worker)
    elif backend == "cuda" and not as_worker and nproc > cuda_device_count:
        raise ConfigError(f"dist.nproc={nproc} but only {cuda_device_count} GPU(s) are present; set dist.nproc={cuda_device_count} or less, "
                          f"or add dist.fake=true to try rank 0 of {nproc} on one GPU (sharding, memory, compile; not speed)")

    check_training(cfg, cuda_device_count, cuda_capability)
    _check_memory(cfg, as_worker, memory)
