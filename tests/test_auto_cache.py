"""kernels=auto's timings kept between runs (src/fusion/auto_cache.py): the same run on the same
machine reads them back; a run that differs is another entry; a machine that differs (GPU, torch,
Triton, the code) times again and says what changed."""
from __future__ import annotations

import json
from pathlib import Path

from src.config.compose import compose_config
from src.fusion.auto_cache import AutoCache, code_hash, run_key
from src.fusion.measure import OpTiming

TIMINGS = [OpTiming("rms_norm", {"eager": 1.5, "compile": 0.9, "triton": 0.7}, {"eager": 0.2, "compile": 0.1, "triton": 0.1}, "triton"),
           OpTiming("block", {"compiled": 12.0, "eager": 15.5}, {}, "compiled", "host charged")]
H100 = {"gpu": "NVIDIA H100 80GB HBM3", "torch": "2.11.0", "triton": "3.6.0", "code": "abc"}


def test_the_same_run_on_the_same_machine_reads_its_timings_back(tmp_path: Path):
    cfg = compose_config(["model=llama3_tiny", "kernels=auto"])
    cache = AutoCache(run_key(cfg, ["rms_norm", "swiglu"]), H100, tmp_path)
    assert cache.lookup() is None and cache.differs() is None
    path = cache.store(TIMINGS)
    again = AutoCache(run_key(compose_config(["model=llama3_tiny", "kernels=auto"]), ["swiglu", "rms_norm"]), H100, tmp_path).lookup()
    assert again is not None and again.path == path and [OpTiming(**t) for t in again.timings] == TIMINGS
    assert again.measured_at.endswith(" UTC") and path.is_relative_to(tmp_path / "kernels_auto")
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # written whole: no temporary file left


def test_what_the_timings_measure_is_in_the_key_and_what_they_do_not_is_not(tmp_path: Path):
    base = run_key(compose_config(["model=llama3_tiny", "kernels=auto"]), ["rms_norm"])
    same = [["model=llama3_tiny", "kernels=auto", "model.hf_path=/somewhere", "train.steps=7", "tracking=none"]]
    other = [["model=llama3_tiny", "kernels=auto", "data.batch_size=3"], ["model=llama3_tiny", "kernels=auto", "data.seq_len=64"],
             ["model=llama3_tiny", "kernels=auto", "precision=fp32"], ["model=llama3_tiny", "kernels=auto", "model.n_layers=3"],
             ["model=llama3_tiny", "kernels=auto", "speed=graphs"], ["model=llama3_tiny", "kernels=auto", "dist.nproc=4"]]
    assert all(run_key(compose_config(o), ["rms_norm"]) == base for o in same)
    assert all(run_key(compose_config(o), ["rms_norm"]) != base for o in other)
    assert run_key(compose_config(["model=llama3_tiny", "kernels=auto"]), ["rms_norm", "swiglu"]) != base


def test_another_torch_or_gpu_times_again_and_names_what_changed(tmp_path: Path):
    run = run_key(compose_config(["model=llama3_tiny", "kernels=auto"]), ["rms_norm"])
    first = AutoCache(run, H100, tmp_path).store(TIMINGS)
    newer = AutoCache(run, {**H100, "torch": "2.13.0"}, tmp_path)
    assert newer.lookup() is None
    assert newer.differs() == f"torch 2.11.0 -> 2.13.0 since {first}"
    h200 = AutoCache(run, {**H100, "gpu": "NVIDIA H200", "code": "def"}, tmp_path)
    assert h200.differs() == f"gpu NVIDIA H100 80GB HBM3 -> NVIDIA H200, the kernels' or models' code since {first}"


def test_a_cut_off_entry_is_timed_again_and_the_code_hash_follows_the_kernels(tmp_path: Path):
    cache = AutoCache(run_key(compose_config(["model=tiny", "kernels=auto"]), []), H100, tmp_path)
    cache.store(TIMINGS)
    cache.path.write_text(cache.path.read_text()[:40])
    assert cache.lookup() is None
    record = json.loads(AutoCache(cache.run, H100, tmp_path).store(TIMINGS).read_text())
    assert record["machine"] == H100 and len(code_hash()) == 16
