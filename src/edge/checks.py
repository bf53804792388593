"""task=infer's own settings checks (src/config/validate.py runs them): the action, backend, sizes, dtype
and target that can run here, refused with the value and the fix before anything starts."""
from __future__ import annotations

import json
import os

from omegaconf import DictConfig, OmegaConf

from src.config.compose import ConfigError

IREE_INSTALL = "pip install iree-base-compiler iree-base-runtime iree-turbine"


def check_infer(cfg: DictConfig, backend: str, cuda_device_count: int, mps_available: bool) -> None:
    from src.edge.targets import BACKEND_DTYPES, METAL_PLATFORMS, known_targets, vulkan_target
    from src.edge.task import default_target

    e = cfg.edge
    if e.action not in ("bench", "compile", "run"):
        raise ConfigError(f"edge.action={e.action}: bench (compile if needed, then time here), compile (artifacts for another device) or run (time artifacts)")
    if backend not in ("vulkan", "mps", "cpu", "cuda"):
        raise ConfigError(f"task=infer runs on backend=vulkan, mps, cpu or cuda, not {backend}")
    if e.action == "compile" and backend not in ("vulkan", "mps"):
        raise ConfigError(f"edge.action=compile makes IREE modules for backend=vulkan or backend=mps (Metal); backend={backend} runs torch directly: use edge.action=bench")
    if e.action == "run" and backend != "vulkan":
        raise ConfigError(f"edge.action=run times Vulkan artifacts (backend=vulkan); backend={backend} has none to run")
    if min(e.batch, e.prompt_len, e.decode_steps, e.repeats) < 1 or e.warmup < 0:
        raise ConfigError("edge.batch, prompt_len, decode_steps and repeats must be at least 1 (warmup 0 or more)")
    if e.max_seq and e.max_seq < e.prompt_len + e.decode_steps:
        raise ConfigError(f"edge.max_seq={e.max_seq} holds fewer positions than prompt_len + decode_steps = {e.prompt_len + e.decode_steps}; raise it or leave it 0")
    if e.dtype not in ("fp32", "fp16", "bf16"):
        raise ConfigError(f"edge.dtype={e.dtype}: fp32, fp16 or bf16")
    from src.edge.matvec import matvec_rows_error

    why = matvec_rows_error(e.matvec_rows)
    if why:
        raise ConfigError(why)
    quant = str(e.quant)
    if quant == "int4":
        from src.edge.quant import group_error
        from src.models import meta_model

        why = group_error(meta_model(cfg.model), quant, e.quant_group)  # the Linears' shapes only, no memory
        if why:
            raise ConfigError(why)
    if e.weights and not os.path.isfile(e.weights):
        raise ConfigError(f"edge.weights={e.weights}: no such file; export one with `python -m src.export CHECKPOINT --out model.safetensors`")
    if e.weights and OmegaConf.select(cfg, "model.hf_path", default=""):
        raise ConfigError(f"edge.weights={e.weights} and model.hf_path={cfg.model.hf_path} both name the weights; give one of them")
    if e.weights:
        why = weights_mismatch(e.weights, cfg.model)
        if why:
            raise ConfigError(why)
    target = default_target(backend, e.target)
    if backend == "mps":
        if e.action == "compile":
            if target not in METAL_PLATFORMS:
                raise ConfigError(f"edge.target={target}: Metal compiles for {', '.join(METAL_PLATFORMS)}")
        elif not mps_available:
            raise ConfigError("backend=mps needs Apple Silicon (torch.backends.mps.is_available() is False here); "
                              "to prepare Metal code here, use edge.action=compile (MSL source)")
        elif e.dtype not in BACKEND_DTYPES["mps"]:
            raise ConfigError(f"edge.dtype={e.dtype}: MPS computes in {', '.join(BACKEND_DTYPES['mps'])}")
    if backend == "cuda" and cuda_device_count == 0:
        raise ConfigError("backend=cuda but no CUDA GPU is visible; use backend=cpu or backend=vulkan")
    if backend == "vulkan" or (backend == "mps" and e.action == "compile"):
        try:
            import iree.runtime  # noqa: F401
            if e.action != "run":
                import iree.compiler  # noqa: F401
                import iree.turbine  # noqa: F401
        except ImportError:
            raise ConfigError(f"backend={backend} goes through IREE, which is not installed: {IREE_INSTALL}") from None
    if backend == "vulkan":
        if e.action == "run":
            manifest = os.path.join(e.artifacts, "manifest.json")
            if not e.artifacts or not os.path.isfile(manifest):
                raise ConfigError(f"edge.artifacts={e.artifacts or '(empty)'}: no manifest.json there; make the artifacts with edge.action=compile")
            with open(manifest) as f:
                m = json.load(f)
            room = m["max_seq"] - m["prompt_len"]
            if e.decode_steps > room:
                raise ConfigError(f"edge.decode_steps={e.decode_steps}: the module at {e.artifacts} caches {m['max_seq']} positions, "
                                  f"its prompt {m['prompt_len']}; use edge.decode_steps<={room}, or compile with a larger edge.decode_steps")
        else:
            spec = vulkan_target(target)
            if spec is None:
                raise ConfigError(f"edge.target={target}: not a Vulkan target IREE knows; use one of {known_targets()}")
            if e.dtype not in spec.dtypes:
                raise ConfigError(f"edge.dtype={e.dtype}: Vulkan target {target} computes in {' or '.join(spec.dtypes)}; use edge.dtype={spec.dtypes[-1]} or fp32")
            if quant != "none" and not spec.storage8:
                raise ConfigError(f"edge.quant={quant}: Vulkan target {target} has no 8-bit storage buffers to read the {quant} weights from "
                                  f"(IREE fails to compile them for it); use edge.quant=none, or a target with 8-bit storage (llvmpipe, valhall, rdna2, ampere)")
        if e.action != "compile":
            from src.edge.runtime import vulkan_devices

            if not vulkan_devices():
                raise ConfigError("backend=vulkan: no Vulkan driver found; install one: `apt-get install mesa-vulkan-drivers` "
                                  "(lavapipe, runs on the CPU) or the GPU vendor's driver")


def weights_mismatch(path: str, model_cfg) -> str | None:
    """Why an export's tensors are not model=...'s (names and shapes, from the file's header), or None."""
    from safetensors import SafetensorError, safe_open

    from src.models import meta_model

    want = {k: tuple(v.shape) for k, v in meta_model(model_cfg).state_dict().items()}
    try:
        with safe_open(path, "pt") as f:
            have = {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}
    except (SafetensorError, OSError, ValueError) as err:
        return f"edge.weights={path}: not a safetensors file ({err}); export one with `python -m src.export CHECKPOINT --out model.safetensors`"
    missing = sorted(set(want) - set(have))
    if missing:
        return f"edge.weights={path}: no {missing[0]} in it, which model={model_cfg.name} has: an export of another model; pass that model's config"
    for name, shape in want.items():
        if have[name] != shape:
            return (f"edge.weights={path}: {name} is {have[name]} there and {shape} in model={model_cfg.name}: an export of another "
                    "shape; pass the model config it was trained with")
    return None
