"""speed.norm_in_copy_in: clipping's gradient norm from the sums of squares the one-rank copy-in leaves.

On one rank with speed.one_rank_copies the reduce-scatter input that speed.reduce_copy_in's kernel
writes (kernels/triton/chunk_cat.py) is the reduce output, and FSDP2 hands out the fp32 gradients as
views of it. The kernel can sum the squares of what it writes as it writes it, so clipping needs no
pass of its own over every fp32 gradient (get_total_norm reads 4 bytes a parameter). The norm is
the same sum in another order (within a few units of fp32's last place of get_total_norm's); the
step is otherwise unchanged.

`SQUARES` keys each output by its storage, with its version counter as written. A gradient whose
storage holds no entry (more than one rank: the gradients are views of the reduce output, another
buffer; FSDP2's own copy under torch.compile; CPU offload) or whose version moved since (accumulated
into, divided, scaled in place) is seen, and its rank sums its own squares the usual way. Entries are
cleared at each step's start and once the norm is taken, so none outlives the step that wrote it.
"""
from __future__ import annotations

import logging

import torch

from src.speed.recipe import Recipe
from src.speed.versions import TRITON_TESTED

log = logging.getLogger(__name__)


class GradSquares:
    """The sums of squares the copy-in left for the buffers it wrote this step, and the global norm
    made from them."""

    def __init__(self) -> None:
        self.on = False
        self._outputs: dict[int, tuple[int, int, torch.Tensor]] = {}  # storage address -> (version when written, elements, partial sums)
        self._told = False

    def record(self, out: torch.Tensor, partials: torch.Tensor, later_writes: int = 0) -> None:
        """`partials` sum to the squared L2 norm of all of `out`, just written; `later_writes` in-place
        writes of the same values are still to come (its version counter then that much further)."""
        self._outputs[out.untyped_storage().data_ptr()] = (out._version + later_writes, out.numel(), partials)

    def clear(self) -> None:
        self._outputs.clear()

    def reset(self) -> None:
        """Off, nothing recorded, the fallback not yet told: as a run starts or ends (one process may run several)."""
        self.on, self._told = False, False
        self.clear()

    def local_squares(self, grads: list[torch.Tensor]) -> torch.Tensor | None:
        """This rank's sum of the squares of `grads` from the recorded sums, or None where one was
        not written by a recorded copy this step, changed since, or is only part of a buffer whose
        other gradients are not among `grads` (a buffer's sum covers all of it: the copy-in takes
        only gradients that fill it, no padding)."""
        from perflab_kernels.triton.adamw import local_shard  # Triton may be missing where this module is imported

        covered: dict[int, int] = {}
        for g in grads:
            t = local_shard(g)
            ptr = t.untyped_storage().data_ptr()
            entry = self._outputs.get(ptr)
            if entry is None or entry[0] != t._version:
                return None
            covered[ptr] = covered.get(ptr, 0) + t.numel()
        if not covered or any(n != self._outputs[ptr][1] for ptr, n in covered.items()):
            return None
        return torch.cat([self._outputs[ptr][2].reshape(-1) for ptr in covered]).sum()

    def norm(self, grads: list[torch.Tensor]) -> torch.Tensor:
        """The global L2 norm of `grads` (what get_total_norm(...).full_tensor() gives, summed in
        another order): this rank's squares, reduced over the mesh dimensions the gradients are
        sharded on. A rank whose gradients the copy-in did not all write sums its own squares the
        usual way, so every rank joins the same collective."""
        from perflab_kernels.triton.adamw import global_norm_from_squares, local_shard, sharding_of

        try:
            local = self.local_squares(grads)
            if local is None and grads:
                # what keeps the sums from covering the gradients (no aliased reduce, a bf16 reduce, offload,
                # accumulation) holds for the run: stop summing, so the fallback costs no more than the pass
                self.on = False
                if not self._told:
                    self._told = True
                    log.info("speed.norm_in_copy_in: the gradients were not all written by the one-rank copy-in (not aliased, "
                             "accumulated, offloaded or copied by torch); the norm is summed in a pass of its own from here on")
                local = torch.nn.utils.get_total_norm([local_shard(g) for g in grads]).float().square()
            sharded = next((s for s in map(sharding_of, grads) if s is not None), None)
            device = local_shard(grads[0]).device if grads else torch.device("cpu")
            return global_norm_from_squares([local] if local is not None else [], sharded, device)
        finally:
            self.clear()


SQUARES = GradSquares()


def divides_gradients(model: torch.nn.Module) -> bool:
    """Whether an FSDP2 group of `model` divides its gradients in the one-rank copy onto the reduce
    output (FSDPModule.set_gradient_divide_factor): that copy then writes other values than the
    copy-in summed, in one write as the plain copy does, so the version counter cannot tell."""
    from src.speed.one_rank import _groups

    return any(getattr(group, "gradient_divide_factor", None) is not None for group in _groups(model))


RECIPE = Recipe(
    name="norm_in_copy_in",
    does="sums the fp32 gradients' squares in speed.reduce_copy_in's kernel as it writes them, and clipping takes its norm from those sums",
    replaces=("torch.nn.utils:get_total_norm",),
    reads=(),
    signatures={"torch.nn.utils:get_total_norm": ("tensors", "norm_type")},
    gain="1.4-1.6% of +exp=llama3_1b_fp8's step: docs/RESULTS.md, Speed recipes",
    parity="tests/integration/test_grad_squares.py::test_the_norm_is_get_total_norms_and_falls_back_to_a_pass_where_the_sums_do_not_cover",
    restore=SQUARES.reset,
    triton=TRITON_TESTED,
    notes=("the same sum in another order (not bit for bit); one rank, with reduce_copy_in and one_rank_copies running",),
    fsdp=False,
)
