"""speed.tied_embedding_grad: a tied embedding's gradient added into the head's where the batch's rows are.

The model's embedding becomes kernels/triton/embedding_grad.py's TiedEmbedding (a class swap: the
same Parameter, state dict and sharding) before compile and sharding. It applies where the head's
weight is the embedding's; not under DDP, whose reducer reads each gradient from a hook of its own
that may run before the one that adds the rows.
"""
from __future__ import annotations

import logging

import torch
import torch.distributed as dist
import torch.nn as nn
from omegaconf import DictConfig

from src.speed.recipe import Recipe
from src.speed.versions import TRITON_TESTED, release, torch_version

VERIFIED: tuple[str, ...] = ("2.11",)
"""torch releases (major.minor) whose CUDA embedding backward the fold matched bit for bit on a GPU
(tests/unit/test_tied_embedding_grad.py's GPU tests); `auto` is off on any other"""

RECIPE = Recipe(
    name="tied_embedding_grad",
    does="adds a tied embedding's gradient into the head's in place, only the rows the batch touched",
    replaces=("torch.nn.modules.sparse:Embedding.forward",),
    reads=("torch.nn.functional:embedding",),
    signatures={"torch.nn.modules.sparse:Embedding.forward": ("self", "input"), "torch.nn.functional:embedding": ("input", "weight")},
    gain="0.2-0.9% of +exp=llama3_1b_fp8's step: docs/RESULTS.md, Speed recipes",
    parity="tests/unit/test_tied_embedding_grad.py::test_on_a_gpu_the_fold_is_torchs_own_backward_and_add",
    restore=lambda: None,  # a class swap on the run's own embedding: nothing of torch's to put back
    torch=VERIFIED,
    triton=TRITON_TESTED[:1],  # the Triton beside the torch of VERIFIED
    notes=("the model's embedding becomes kernels/triton/embedding_grad.py's TiedEmbedding before sharding; not under DDP",),
    fsdp=False,
)

log = logging.getLogger("src.train")


def why_off(cfg: DictConfig, model: nn.Module, device: torch.device, ddp: bool) -> str | None:
    """Why speed.tied_embedding_grad does not run in this run (None: it runs). `auto` runs on CUDA on a
    torch whose embedding backward its GPU tests matched (VERIFIED); `on` on any CUDA run, and on a
    CPU under Triton's interpreter."""
    from perflab_kernels.triton.device import interpreted

    embed, head = getattr(model, "embed", None), getattr(model, "head", None)
    if not isinstance(embed, nn.Embedding) or getattr(head, "weight", None) is not embed.weight:
        return "the head's weight is not the embedding's"
    if ddp:
        return "DDP's reducer reads the gradient before the rows are added"
    use = str(cfg.speed.tied_embedding_grad)
    if device.type != "cuda" and not (use == "on" and device.type == "cpu" and interpreted()):
        return "its kernels run on CUDA (on a CPU with speed.tied_embedding_grad=on, under Triton's interpreter)"
    if use == "auto" and release(torch_version()) not in VERIFIED and not cfg.speed.force_unverified:
        checked = f"on torch {', '.join(VERIFIED)}" if VERIFIED else "on no torch yet"
        return f"its sums were matched to torch's CUDA embedding backward {checked}, not on {torch_version()} (speed.tied_embedding_grad=on runs it)"
    return None


def tie_embedding_gradient(cfg: DictConfig, model: nn.Module, device: torch.device, main: bool) -> bool:
    """Swap the model's embedding to TiedEmbedding where speed.tied_embedding_grad runs; True where it does."""
    if str(cfg.speed.tied_embedding_grad) == "off":
        return False
    ddp = cfg.sharding.strategy == "none" and dist.is_initialized() and dist.get_world_size() > 1
    why = why_off(cfg, model, device, ddp)
    if why is None:
        from perflab_kernels.triton.embedding_grad import tie_gradient

        if tie_gradient(model.embed):
            if main:
                log.info("speed.tied_embedding_grad: the embedding's rows added into the tied head's gradient in place "
                         "(kernels/triton/embedding_grad.py), no full-size embedding gradient")
            return True
        why = "the embedding has padding_idx, max_norm, scale_grad_by_freq or sparse, which torch sums otherwise"
    if main:  # asked for by name: said; `auto` where it does not apply (a CPU run, an untied head): off without a word
        log.log(logging.INFO if str(cfg.speed.tied_embedding_grad) == "on" else logging.DEBUG,
                "speed.tied_embedding_grad: off in this run (%s); autograd adds the embedding's full-size gradient", why)
    return False
