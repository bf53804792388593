"""The speed layer (src/speed/): every recipe declares what it touches and probes clean on this torch;
on a torch it was not verified on it is off with one warning line, or refused in one line where it
was asked for by name; a symbol torch removed or changed turns it off whatever is forced; the
`torch` preset changes no torch attribute, and a run that replaced some puts them all back."""
from __future__ import annotations

import ast
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from src.config.compose import ConfigError, compose_config
from src.config.validate import validate
from src.runtime import RunContext
from src.speed import RECIPES, grad_upcast, keep_unsharded
from src.speed.apply import decide, install_fsdp
from src.speed.recipe import FSDP, Recipe
from src.speed.versions import release, torch_version

REPO = Path(__file__).resolve().parents[2]
ONE_RANK = ["dist.nproc=1", "train.steps=3", "data.seq_len=32", "data.batch_size=2", "tracking=none", "train.progress=false"]


def _test_names(path: Path) -> set[str]:
    return {n.name for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.FunctionDef) and n.name.startswith("test_")}


@pytest.mark.parametrize("name", list(RECIPES))
def test_each_recipe_probes_clean_here_and_names_a_parity_test_that_exists(name):
    recipe = RECIPES[name]
    assert recipe.probe() == [], recipe.probe()
    # torch 2.15+ keeps unsharded storage itself: no recipe runs there; a recipe verified on fewer releases is off on the others
    if not recipe.native() and release(torch_version()) in recipe.torch:
        assert recipe.why_not() is None
    assert recipe.replaces and recipe.gain and "docs/RESULTS.md" in recipe.gain
    path, _, test = recipe.parity.partition("::")
    assert test in _test_names(REPO / path), recipe.parity


def _off_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING and r.getMessage().startswith("speed.")]


def test_on_a_torch_it_was_not_verified_on_an_auto_recipe_is_off_with_one_warning(monkeypatch, caplog):
    """A patched version string: every recipe that would run on this CUDA run of one rank is off,
    each with its one line, and nothing of FSDP2's is replaced."""
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    monkeypatch.setattr(torch, "__version__", "2.16.0")
    cfg = compose_config(["+exp=fsdp4_fp8", "dist.nproc=1"])
    verdicts = decide(cfg, 1, "cuda", "float32")
    applying = ["reduce_copy_in", "one_rank_copies", "keep_unsharded"]  # one rank, an fp32 reduce; cast_in_step follows one_rank_copies
    assert not any(v.on for n, v in verdicts.items() if n != "keep_unsharded" or not keep_unsharded.public())
    for name in applying[:2]:
        assert verdicts[name].warning == (f"speed.{name}: off, torch's own path instead: verified on torch 2.11, 2.13, 2.14, 2.15, "
                                          "not on torch 2.16.0 (speed.force_unverified=true runs it anyway)")
    before = _fsdp_collectives.foreach_reduce_scatter_copy_in
    with caplog.at_level(logging.WARNING, logger="src.train"):
        # keep_unsharded's verdict as it is but not run: a plain Linear has no FSDP2 units to keep
        install_fsdp(torch.nn.Linear(2, 2), {**verdicts, "keep_unsharded": type(verdicts["keep_unsharded"])(False, verdicts["keep_unsharded"].warning)},
                     "bfloat16", main=True)
    assert sorted(_off_lines(caplog)) == sorted(v.warning for v in verdicts.values() if v.warning)
    assert len(_off_lines(caplog)) == (2 if keep_unsharded.public() else 3)
    assert _fsdp_collectives.foreach_reduce_scatter_copy_in is before
    forced = decide(compose_config(["+exp=fsdp4_fp8", "dist.nproc=1", "speed.force_unverified=true"]), 1, "cuda", "float32")
    assert forced["reduce_copy_in"].on and forced["one_rank_copies"].on and forced["cast_in_step"].on


def test_asked_for_by_name_on_an_unverified_torch_is_refused_in_one_line(monkeypatch):
    monkeypatch.setattr(torch, "__version__", "2.16.0a0+git1234")
    cfg = compose_config(["speed.reduce_copy_in=on"])
    with pytest.raises(ConfigError) as err:
        validate(cfg, cuda_device_count=0, mps_available=False)
    line = str(err.value)
    assert line == ("speed.reduce_copy_in=on copies FSDP2's unsharded gradients into the reduce-scatter input with a vectorised Triton kernel, "
                    "verified on torch 2.11, 2.13, 2.14, 2.15, not on torch 2.16.0a0+git1234; add speed.force_unverified=true to run it anyway, "
                    "or set speed.reduce_copy_in=auto (off where unverified)")
    validate(compose_config(["speed.reduce_copy_in=on", "speed.force_unverified=true"]), cuda_device_count=0, mps_available=False)
    validate(compose_config(["speed.reduce_copy_in=auto"]), cuda_device_count=0, mps_available=False)  # auto: off, with a warning, at run time


def test_a_triton_release_its_kernels_were_not_verified_on_turns_the_kernel_recipes_off(monkeypatch):
    import triton

    monkeypatch.setattr(triton, "__version__", "3.99.0")
    assert grad_upcast.RECIPE.why_not() == "its Triton kernels verified on Triton 3.6, 3.8, 3.9, not on Triton 3.99.0"
    assert RECIPES["one_rank_copies"].why_not() is None  # no Triton kernel of its own


def test_a_symbol_torch_removed_or_changed_turns_a_recipe_off_and_forcing_cannot_bring_it_back(monkeypatch):
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives

    gone = Recipe(name="gone", does="tries", replaces=(f"{FSDP}._fsdp_collectives:no_such_function",),
                  reads=(f"{FSDP}._fsdp_param:FSDPParam.no_such_attribute", f"{FSDP}._fsdp_param:FSDPParam._sharded_param_data"),
                  signatures={}, gain="", parity="", restore=lambda: None)
    assert gone.probe() == [f"{FSDP}._fsdp_collectives:no_such_function", f"{FSDP}._fsdp_param:FSDPParam.no_such_attribute"]
    assert gone.why_not(force=True).startswith(f"torch {torch.__version__} lacks {FSDP}._fsdp_collectives:no_such_function and 1 more")
    assert gone.refusal(force=True).endswith("; set speed.gone=off (torch's own path)")
    # torch's function now takes other parameters than the replacement was written for
    monkeypatch.setattr(_fsdp_collectives, "_to_dtype_if_needed", lambda tensor, dtype, non_blocking=False: tensor)
    assert grad_upcast.RECIPE.probe() == []  # leading parameters as written for: still fits
    monkeypatch.setattr(_fsdp_collectives, "_to_dtype_if_needed", lambda x, dtype: x)
    assert grad_upcast.RECIPE.probe() == [f"{FSDP}._fsdp_collectives:_to_dtype_if_needed(x, dtype) (written for (tensor, dtype))"]
    assert "set speed.grad_upcast=off" in grad_upcast.RECIPE.refusal(force=True)
    off = decide(compose_config(["precision.reduce_dtype=bfloat16", "speed.force_unverified=true"]), 2, "cuda", "bfloat16")["grad_upcast"]
    assert not off.on and "lacks" in off.warning and "force_unverified" not in off.warning


def _snapshot() -> dict[str, object]:
    """Every attribute of the FSDP2 modules and classes the recipes touch, and Inductor's config."""
    import torch._inductor.config as inductor
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives, _fsdp_param, _fsdp_param_group

    owners = {"_fsdp_collectives": vars(_fsdp_collectives), "FSDPParam": vars(_fsdp_param.FSDPParam),
              "FSDPParamGroup": vars(_fsdp_param_group.FSDPParamGroup), "FSDPModule": vars(FSDPModule)}
    snap: dict[str, object] = {f"{o}.{k}": v for o, d in owners.items() for k, v in d.items() if not k.startswith("__")}
    snap.update({f"inductor.{k}": v for k, v in inductor.get_config_copy().items()})
    return snap


def _changed(a: dict, b: dict) -> list[str]:
    return sorted(k for k in a.keys() | b.keys() if a.get(k) is not b.get(k) and a.get(k) != b.get(k))


def _run_and_snapshot(tmp_path: Path, name: str, overrides: list[str], monkeypatch) -> tuple[dict, dict]:
    """A one-rank run in this process: the snapshot once its model and optimizer are built, its summary."""
    from src.train.trainer import Trainer
    from src.train.worker import train

    during: dict = {}
    build = Trainer.build
    monkeypatch.setattr(Trainer, "build", lambda self: build(self) or during.update(_snapshot()))
    run_dir = tmp_path / name
    run_dir.mkdir()
    train(compose_config([*ONE_RANK, *overrides]), RunContext(run_dir=str(run_dir), cwd=str(tmp_path)))
    return during, json.loads((run_dir / "summary.json").read_text())


def test_the_torch_preset_changes_no_torch_attribute_and_a_run_puts_back_what_it_replaced(tmp_path, in_process_runs, monkeypatch):
    from src.speed import restore_all

    restore_all()  # torch's own, whatever a test before this one in the process left installed
    before = _snapshot()
    during, summary = _run_and_snapshot(tmp_path, "torch", ["speed=torch", "precision.reduce_dtype=bfloat16"], monkeypatch)
    assert _changed(before, during) == [] and _changed(before, _snapshot()) == []
    assert summary["speed_recipes"] == []
    # the same run asking for recipes by name: FSDP2's functions replaced while it trains, torch's own after
    asked = ["speed.reduce_copy_in=on", "speed.one_rank_copies=on", "speed.keep_unsharded=true", "precision.reduce_dtype=bfloat16"]
    during, summary = _run_and_snapshot(tmp_path, "asked", asked, monkeypatch)
    replaced = {"_fsdp_collectives.foreach_reduce_scatter_copy_in", "FSDPParamGroup.wait_for_unshard", "FSDPParam.all_gather_inputs"}
    if not keep_unsharded.public():
        replaced.add("FSDPParam.free_unsharded_param")
    assert set(_changed(before, during)) == replaced
    # norm_in_copy_in (auto under speed=copies) rides on the two recipes and patches nothing of torch's
    assert set(summary["speed_recipes"]) == {"reduce_copy_in", "one_rank_copies", "keep_unsharded", "norm_in_copy_in"}
    assert _changed(before, _snapshot()) == []


def test_python_m_src_speed_lists_every_recipe_and_probes_this_torch():
    proc = subprocess.run([sys.executable, "-m", "src.speed", "--markdown"], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("| knob | replaces | torch verified |") and f"on torch {torch.__version__}" in lines[0]
    assert [line.split(" | ")[0] for line in lines[2:]] == [f"| `speed.{n}`" for n in RECIPES]


def test_python_m_src_speed_reads_at_80_columns():
    """A block per recipe: every knob whole at the start of its line, nothing past 80 columns."""
    proc = subprocess.run([sys.executable, "-m", "src.speed"], cwd=REPO, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "COLUMNS": "80"})
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert max(len(line) for line in lines) <= 80 and "…" not in proc.stdout
    assert [line.split(":")[0] for line in lines if line.startswith("speed.")] == [f"speed.{n}" for n in RECIPES]
    assert len(lines) <= 7 * len(RECIPES)
