"""Which kernel runs scaled_dot_product_attention (kernels.attention).

torch picks flash attention first for bf16 on CUDA; cuDNN's fused attention is written for Hopper
(TMA, warp-specialised) and is the one to try there. The choice is process-wide, through torch's
own switches, so torch.compile traces the same kernel eager runs: set it before the first forward.
"""
from __future__ import annotations

import torch

# math stays on as the fallback torch takes when the chosen kernel cannot run a shape
_SWITCHES = {
    "flash": torch.backends.cuda.enable_flash_sdp,
    "efficient": torch.backends.cuda.enable_mem_efficient_sdp,
    "cudnn": torch.backends.cuda.enable_cudnn_sdp,
}


def use_sdpa_backend(name: str) -> None:
    """Leave only `name` of flash / efficient / cudnn switched on ("default": torch's own order)."""
    if name == "default":
        return
    if name not in _SWITCHES:
        raise ValueError(f"kernels.attention={name}: use default, {', '.join(_SWITCHES)}")
    for backend, switch in _SWITCHES.items():
        switch(backend == name)
