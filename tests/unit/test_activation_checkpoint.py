"""Activation checkpointing (src/distributed/activation_checkpoint.py): the same fp32 losses as none,
run by run (FSDP2 on one rank, in process; under torch.compile too), and fewer bytes kept for backward:
full fewer than op-level, op-level fewer than none."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from src.config.compose import compose_config
from src.distributed.activation_checkpoint import apply_activation_checkpointing
from src.runtime import RunContext

SMALL = ["dist.nproc=1", "precision=fp32", "train.steps=3", "data.seq_len=48", "data.batch_size=2", "tracking=none", "train.progress=false"]


def _losses(tmp_path: Path, name: str, overrides: list[str]) -> list[float]:
    from src.train.worker import train

    run_dir = tmp_path / name
    run_dir.mkdir()
    train(compose_config([*SMALL, *overrides]), RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("model", ["llama3_tiny", "tiny"])
def test_checkpointed_runs_give_the_losses_of_none(tmp_path, in_process_runs, model):
    base = _losses(tmp_path, "none", [f"model={model}"])
    for mode in (["ac.mode=full"], ["ac.mode=selective", "ac.selective=op"], ["ac.mode=selective", "ac.selective=2"]):
        assert _losses(tmp_path, "_".join(mode).replace("=", "-"), [f"model={model}", *mode]) == base, mode
    assert base[-1] < base[0]


def test_checkpointed_compiled_blocks_give_the_losses_of_compiled_ones(tmp_path, in_process_runs):
    """Compile after the wrap (torchtitan's order): Dynamo traces the checkpointed forward; aot_eager
    keeps torch's kernels, so the fp32 losses match the uncheckpointed compiled run closely."""
    compiled = ["model=llama3_tiny", "kernels=compile", "kernels.compile_backend=aot_eager"]
    base = _losses(tmp_path, "compiled", compiled)
    assert _losses(tmp_path, "compiled_ac", [*compiled, "ac.mode=selective", "ac.selective=op"]) == pytest.approx(base, rel=1e-6)


def _kept_and_recomputed(mode: str, selective: str = "op") -> tuple[int, int]:
    """Over one forward and backward of a small LLaMA 3: the bytes autograd keeps outside checkpointed
    regions (a checkpointed block keeps its input there; what op-level keeps inside stays with the
    checkpoint), and the matmuls backward runs (its own, and those recomputed)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from src.models.llama3.model import Llama3

    class CountMatmuls(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func in (torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default)
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    model = Llama3(vocab_size=64, dim=64, n_layers=4, n_heads=4, n_kv_heads=2, ffn_hidden=192)
    apply_activation_checkpointing(model, mode, selective)
    kept = []

    def pack(t):
        if not isinstance(t, torch.nn.Parameter):
            kept.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        loss = model(torch.randint(0, 64, (2, 128))).sum()
    with CountMatmuls() as counter:
        loss.backward()
    return sum(kept), counter.n


def test_checkpointing_keeps_fewer_activations_and_recomputes_what_it_dropped():
    none, op, every2, full = (_kept_and_recomputed("none"), _kept_and_recomputed("selective", "op"),
                              _kept_and_recomputed("selective", "2"), _kept_and_recomputed("full"))
    assert full[0] < every2[0] < none[0] and op[0] == full[0]  # each checkpointed block keeps its input alone outside
    # backward's own matmuls, plus the forward's again where they were not kept: op-level keeps every other one
    assert none[1] < op[1] < full[1] and none[1] < every2[1] < full[1]
