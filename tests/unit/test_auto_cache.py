"""kernels=auto's timings kept between runs (src/fusion/auto_cache.py): the same run on the same
machine reads them back; a run that differs is another entry; a machine that differs (GPU, torch,
Triton, the code) times again and says what changed."""
from __future__ import annotations

import json
import logging
import re
from pathlib import Path

import pytest

from src.config.compose import compose_config
from src.fusion.auto_cache import AutoCache, CacheRefused, code_hash, run_key
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


def test_a_cut_off_or_foreign_entry_is_refused_in_one_line_and_written_whole_again(tmp_path: Path):
    cache = AutoCache(run_key(compose_config(["model=tiny", "kernels=auto"]), []), H100, tmp_path)
    cache.store(TIMINGS)
    cache.path.write_text(cache.path.read_text()[:40])
    with pytest.raises(CacheRefused, match=rf"^{re.escape(str(cache.path))} is cut off or not a timing record \(JSONDecodeError: "):
        cache.lookup()
    record = json.loads(cache.store(TIMINGS).read_text())
    assert record["machine"] == H100 and cache.lookup().timings == record["timings"]
    foreign = AutoCache(run_key(compose_config(["model=small", "kernels=auto"]), []), H100, tmp_path)
    foreign.folder.mkdir(parents=True)
    foreign.path.write_text(cache.path.read_text())  # another run's record under this run's name
    with pytest.raises(CacheRefused, match="holds the timings of another run or machine than its name says"):
        foreign.lookup()
    foreign.path.write_text(json.dumps({"run": foreign.run, "machine": H100, "measured_at": "x", "timings": [1, 2]}))
    with pytest.raises(CacheRefused, match="its timings are not a list of op timings"):
        foreign.lookup()
    assert len(code_hash()) == 16


def test_a_refused_entry_is_logged_and_timed_again(tmp_path: Path, monkeypatch, caplog):
    """apply_auto_choice's timing step (src/fusion/choice.py) on a cut-off entry: one warning line
    naming the file, then the candidates timed (here a stand-in for the GPU) and the file written whole."""
    import src.fusion.auto_cache as auto_cache
    import src.fusion.measure as measure
    from src.fusion.choice import _timings

    monkeypatch.setenv("PERFLAB_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(auto_cache, "gpu_name", lambda: H100["gpu"])
    monkeypatch.setattr(measure, "measure_on_gpu", lambda ops, cfg: TIMINGS)  # no GPU here: its result, injected
    cfg = compose_config(["model=tiny", "kernels=auto"])
    assert _timings(cfg, ["rms_norm"]) == TIMINGS
    (path,) = (tmp_path / "kernels_auto").glob("*/*.json")
    path.write_text("{")
    with caplog.at_level(logging.INFO, logger="src.run"):
        assert _timings(cfg, ["rms_norm"]) == TIMINGS
    lines = [r.getMessage() for r in caplog.records]
    assert any(line.startswith(f"kernels=auto: {path} is cut off or not a timing record") and line.endswith("; timing again") for line in lines)
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="src.run"):
        assert _timings(cfg, ["rms_norm"]) == TIMINGS
    assert any("kernels=auto: reusing the timings measured " in r.getMessage() and str(path) in r.getMessage() for r in caplog.records)
