"""A small two-unit FSDP2 model: the sharded gradients after one backward, once per routing of one of
FSDP2's copies, for the tests that compare a recipe's route against torch's bit for bit. On one NCCL
rank (a GPU, no launcher), or on gloo ranks on a CPU, where the recipes' Triton kernels run in
Triton's interpreter."""
from __future__ import annotations

from collections.abc import Callable

import torch


def _grads_per_route(device: str, reduce_dtype: torch.dtype, route: Callable[[str], None], choices) -> dict[str, list[torch.Tensor]]:
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh(device, (dist.get_world_size(),))
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
    g = torch.Generator().manual_seed(1 + dist.get_rank())
    x = torch.randn(37, 63, generator=g).to(device)
    grads = {}
    for choice in choices:
        torch.manual_seed(0)
        # rows that split evenly over two ranks (torch pads those that do not, which the copy-in kernel
        # leaves to torch), columns that do not fill a vector
        model = nn.Sequential(nn.Linear(63, 98), nn.ReLU(), nn.Linear(98, 34)).to(device)
        for layer in (model[0], model[2]):
            fully_shard(layer, mesh=mesh, mp_policy=policy)
        fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: no parameters of its own
        route(choice)
        model(x).float().square().mean().backward()
        grads[choice] = [p.grad.full_tensor().cpu() for p in model.parameters()]
    return grads


def sharded_grads_per_route(reduce_dtype: torch.dtype, route: Callable[[str], None], choices=("torch", "triton")) -> dict[str, list[torch.Tensor]]:
    """For each choice on one NCCL rank: `route(choice)` installs or restores the route, then a fresh
    model (the same seed) runs one forward and backward in bf16; its full gradients per choice."""
    import torch.distributed as dist

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        return _grads_per_route("cuda", reduce_dtype, route, choices)
    finally:
        dist.destroy_process_group()


def gloo_grads_per_route(rank: int, init_file: str, out: str, world: int, reduce_dtype: torch.dtype, install: Callable[[], bool],
                         restore: Callable[[], None], kernel_module: str, kernel_name: str) -> None:
    """One gloo rank of `world` (spawned: tests/support/ranks.py): the gradients with torch's path and
    with the recipe's (`install`), and how often the recipe's kernel ran; rank 0 saves them to `out`."""
    import importlib
    import os

    import torch.distributed as dist

    # the kernels run on the gloo ranks' CPU tensors in Triton's interpreter, on a machine with a GPU
    # too: read when kernels/triton is first imported, which in this fresh process is below
    os.environ["TRITON_INTERPRET"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    module = importlib.import_module(kernel_module)
    kernel, calls = getattr(module, kernel_name), []
    setattr(module, kernel_name, lambda *a, **k: calls.append(1) or kernel(*a, **k))

    def route(choice: str) -> None:
        if choice == "recipe":
            assert install()
        else:
            restore()

    try:
        grads = _grads_per_route("cpu", reduce_dtype, route, ("torch", "recipe"))
        if rank == 0:
            torch.save({"grads": grads, "calls": len(calls)}, out)
    finally:
        restore()
        setattr(module, kernel_name, kernel)
        dist.destroy_process_group()
