"""Trace a pre-norm block's fused norms with Dynamo, fullgraph=True, and print (as JSON, last line)
the Triton launches in each traced forward and backward body. Traced only, never run: on a machine
without a GPU Dynamo leaves Triton kernels out of graphs (torch.utils._triton.has_triton), so that
gate is opened here; this process must not run Triton's interpreter (TRITON_INTERPRET unset).
Run by tests/integration/test_kernel_rms_norm.py as `python -m tests.support.trace_fused_norms`."""
from __future__ import annotations

import json

import torch
import torch._dynamo
import torch.utils._triton

torch.utils._triton.has_triton = lambda *args, **kwargs: True  # read by Dynamo's variable builder at each call (2.15 passes include_cpu)

from perflab_kernels.triton.rms_norm import fused_add_rms_norm, fused_rms_norm  # noqa: E402


class Traced(Exception):
    pass


def main() -> None:
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        raise Traced  # the graph is all this wants; running it would need a GPU

    def block(x, r, w):
        s, y = fused_add_rms_norm(x * 0.5, r, w, 1e-6)
        return s, torch.nn.functional.silu(fused_rms_norm(y, w, 1e-6))

    x, r = (torch.randn(5, 7, 64, requires_grad=True) for _ in range(2))
    w = torch.rand(64, requires_grad=True)
    try:
        torch.compile(block, backend=capture, fullgraph=True)(x, r, w)
    except Exception:  # a break under fullgraph=True raises before the backend sees a graph
        if not graphs:
            raise
    (gm,) = graphs
    bodies = {name: module.code for name, module in gm.named_children() if name.startswith(("fwd_body", "bwd_body"))}
    print(json.dumps({name: code.count("triton_kernel_wrapper_mutation(") for name, code in sorted(bodies.items())}))


if __name__ == "__main__":
    main()
