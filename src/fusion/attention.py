"""Which kernel runs scaled_dot_product_attention (kernels.attention).

torch picks flash attention first for bf16 on CUDA; cuDNN's fused attention is written for Hopper
(TMA, warp-specialised) and is the one to try there. The choice is process-wide, through torch's
own switches, so torch.compile traces the same kernel eager runs: set it before the first forward,
and put back when the run ends (restore_sdpa_backends), so a later run in the process starts from torch's.
"""
from __future__ import annotations

import torch

# math stays on as the fallback torch takes when the chosen kernel cannot run a shape
_SWITCHES = {
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
}
_STATES = {
    "flash": torch.backends.cuda.flash_sdp_enabled,
    "efficient": torch.backends.cuda.mem_efficient_sdp_enabled,
    "cudnn": torch.backends.cuda.cudnn_sdp_enabled,
}
_saved: dict[str, bool] | None = None  # the switches as torch had them before the first use_sdpa_backend


def use_sdpa_backend(name: str) -> None:
    """Leave only `name` of flash / efficient / cudnn switched on ("default": torch's own order)."""
    if name == "default":
        return
    if name not in _SWITCHES:
        raise ValueError(f"kernels.attention={name}: use default, {', '.join(_SWITCHES)}")
    global _saved
    if _saved is None:
        _saved = {backend: state() for backend, state in _STATES.items()}
    for backend, switch in _SWITCHES.items():
        switch(backend == name)


def restore_sdpa_backends() -> None:
    """The switches as they were before use_sdpa_backend changed them (nothing to do if it did not)."""
    global _saved
    if _saved is None:
        return
    for backend, on in _saved.items():
        _SWITCHES[backend](on)
    _saved = None
