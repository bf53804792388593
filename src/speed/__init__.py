"""Every speed-up that reaches into torch's internals, in one place (the `speed` config group).

A recipe (src/speed/recipe.py) replaces a function or method of FSDP2 for the length of a run and
declares what it touches: its knob, the torch symbols it replaces and reads, the torch and Triton
releases its parity test passed on, where its gain is recorded, and the test that holds it to
torch's own path bit for bit. `python -m src.speed` prints the table and probes this torch.

    grad_upcast, reduce_copy_in                   FSDP2's casts and copies (src/speed/*.py)
    one_rank_copies, cast_in_step                 FSDP2 on a one-rank shard group (one_rank.py)
    keep_unsharded                                FSDPParam.free_unsharded_param, before torch 2.15
    norm_in_copy_in                               clipping's norm from the copy-in's sums (grad_squares.py)
    tied_embedding_grad                           a tied head's embedding gradient (tied_embedding.py)

`install(...)` puts every lever of a run in place in one call, each where it must go around
FSDP2's fully_shard (src/speed/apply.py); cast_in_step's is the Trainer's, once the optimizer exists.

On a torch a recipe was not verified on it is off with one warning line (`auto`), or refused in
one line where it was asked for by name (`on`), unless `speed.force_unverified=true`. Inductor
settings a run needs are scoped to the run (src/speed/inductor.py). Each run puts torch's own
functions back when it ends (src/speed/apply.py).
"""
from __future__ import annotations

from src.speed import grad_squares, grad_upcast, keep_unsharded, one_rank, reduce_copy_in, tied_embedding
from src.speed.recipe import Recipe

RECIPES: dict[str, Recipe] = {r.name: r for r in (
    grad_upcast.RECIPE, reduce_copy_in.RECIPE, one_rank.RECIPE, one_rank.CAST_RECIPE, keep_unsharded.RECIPE,
    grad_squares.RECIPE, tied_embedding.RECIPE)}


def restore_all() -> None:
    """torch's own functions back wherever a recipe's replacement is still in place, and the copy-in
    summing no squares (speed.norm_in_copy_in) for whatever runs next in the process."""
    for recipe in RECIPES.values():
        recipe.restore()


# after RECIPES: apply.py reads it
from src.speed.apply import install as install  # noqa: E402
