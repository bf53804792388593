"""AdamW as optim.impl asks: fused, foreach, for_loop or triton kernels (the same update, other launches).

AdamW took 7% of device kernel time in the seed's step on 2 H200s and 9.5% of one H200's in its
diagnosis (docs/PERFORMANCE.md section 2): for_loop launches each elementwise op of the update per
parameter, foreach per batch of parameters (multi_tensor_apply), fused the whole update in one
kernel per batch, triton the whole update of every parameter in one launch with the gradients'
sum of squares on the way (kernels/triton/adamw.py), so a logged step's gradient norm needs no
second pass over the gradients. Each rank's host memory is logged per step (host_rss_mb), so a
leak of one implementation (fused AdamW over DTensor parameters on torch 2.10/2.11) shows as
host_rss_growth_mb.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
from omegaconf import DictConfig


def optimizer_impl(impl: str, device_type: str, cpu_offload: bool) -> str:
    """optim.impl=auto: fused on CUDA; foreach elsewhere, and for parameters offloaded to host
    memory (what the default was before optim.impl: fused only for CUDA parameters)."""
    if impl != "auto":
        return impl
    return "fused" if device_type == "cuda" and not cpu_offload else "foreach"


def build_optimizer(params, o: DictConfig, device_type: str, cpu_offload: bool) -> torch.optim.AdamW:
    impl = optimizer_impl(o.impl, device_type, cpu_offload)
    if impl == "triton":
        return TritonAdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay)
    kernels = {"fused": True} if impl == "fused" else {"foreach": impl == "foreach"}
    return torch.optim.AdamW(params, lr=o.lr, betas=tuple(o.betas), eps=o.eps, weight_decay=o.weight_decay, **kernels)


def _local(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's own shard (FSDP2's parameters, gradients and the moments made like them)."""
    return t._local_tensor if hasattr(t, "_local_tensor") else t


class TritonAdamW(torch.optim.AdamW):
    """torch's AdamW (same param groups, same state: `step`, `exp_avg`, `exp_avg_sq`, so state dicts,
    DCP checkpoints and resumes are AdamW's) whose step runs kernels/triton/adamw.py over every
    parameter of a group in one launch. With `grad_norm_wanted` set, step() also leaves the global
    L2 norm of the gradients it read in `last_grad_norm` (a device scalar, no host sync), summed
    over the mesh dimensions the parameters are sharded on, which is what get_total_norm returns."""

    def __init__(self, params, lr: float, betas: tuple[float, float], eps: float, weight_decay: float):
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, foreach=False)
        self._tables: dict[tuple[int, ...], object] = {}
        self.grad_norm_wanted = False
        self.last_grad_norm: torch.Tensor | None = None

    @torch.no_grad()
    def step(self, closure=None):
        from kernels.triton.adamw import GRAD_DTYPES, TileTable, adamw_step_

        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        squares, sharded = [], None
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"] or group.get("capturable") or group.get("differentiable"):
                raise ValueError("optim.impl=triton runs plain AdamW: no amsgrad, maximize, capturable or differentiable")
            by_step: dict[float, tuple[list, list, list, list]] = {}
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["step"] += 1
                if sharded is None and hasattr(p, "placements"):
                    sharded = (p.device_mesh, tuple(i for i, pl in enumerate(p.placements) if pl.is_shard()))
                tensors = (_local(p), _local(p.grad), _local(state["exp_avg"]), _local(state["exp_avg_sq"]))
                if tensors[0].dtype != torch.float32 or tensors[1].dtype not in GRAD_DTYPES or not all(t.is_contiguous() for t in tensors):
                    raise ValueError(f"optim.impl=triton updates contiguous fp32 parameters with fp32 or bf16 gradients; got a {tensors[0].dtype} "
                                     f"parameter with a {tensors[1].dtype} gradient; use optim.impl=fused")
                lists = by_step.setdefault(float(state["step"]), ([], [], [], []))
                for lst, t in zip(lists, tensors):
                    lst.append(t)
            for step, (ps, gs, ms, vs) in by_step.items():
                for grad_dtype in {g.dtype for g in gs}:  # one launch per gradient dtype (one, in practice)
                    pick = [i for i, g in enumerate(gs) if g.dtype == grad_dtype]
                    sel = [[lst[i] for i in pick] for lst in (ps, gs, ms, vs)]
                    numels = tuple(t.numel() for t in sel[0])
                    table = self._tables.get(numels)
                    if table is None:
                        table = self._tables[numels] = TileTable(list(numels), sel[0][0].device)
                    sq = adamw_step_(*sel, table, step=int(step), lr=float(group["lr"]), beta1=group["betas"][0], beta2=group["betas"][1],
                                     eps=group["eps"], weight_decay=group["weight_decay"], want_squares=self.grad_norm_wanted)
                    if sq is not None:
                        squares.append(sq)
        if self.grad_norm_wanted:
            self.last_grad_norm = self._global_norm(squares, sharded)
        return loss

    @staticmethod
    def _global_norm(squares: list[torch.Tensor], sharded) -> torch.Tensor:
        total = torch.stack(squares).sum() if squares else torch.zeros(())
        if sharded is not None and dist.is_initialized():
            mesh, dims = sharded
            for d in dims:  # the shards' sums of squares; replicated dimensions hold the same sum already
                dist.all_reduce(total, group=mesh.get_group(d))
        return total.sqrt()


def norm_in_update(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer.step()` can leave the global grad norm behind (TritonAdamW)."""
    return isinstance(optimizer, TritonAdamW)
