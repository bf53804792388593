"""One NCCL rank (a GPU, no launcher) and a small two-unit FSDP2 model: the sharded gradients after
one backward, once per routing of one of FSDP2's copies, for the GPU tests that compare a Triton
route against torch's bit for bit."""
from __future__ import annotations

from collections.abc import Callable

import torch


def sharded_grads_per_route(reduce_dtype: torch.dtype, route: Callable[[str], None], choices=("torch", "triton")) -> dict[str, list[torch.Tensor]]:
    """For each choice: `route(choice)` installs or restores the route, then a fresh model (the same
    seed) runs one forward and backward in bf16; its full gradients are returned per choice."""
    import torch.distributed as dist
    import torch.nn as nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    dist.init_process_group("nccl", store=dist.HashStore(), rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cuda", (1,))
        policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=reduce_dtype)
        x = torch.randn(37, 64, device="cuda")
        grads = {}
        for choice in choices:
            torch.manual_seed(0)
            model = nn.Sequential(nn.Linear(64, 96), nn.ReLU(), nn.Linear(96, 33)).cuda()
            for layer in (model[0], model[2]):
                fully_shard(layer, mesh=mesh, mp_policy=policy)
            fully_shard(model, mesh=mesh, mp_policy=policy)  # the root: no parameters of its own
            route(choice)
            model(x).float().square().mean().backward()
            grads[choice] = [p.grad.full_tensor() for p in model.parameters()]
        return grads
    finally:
        dist.destroy_process_group()
