"""The helper commands refuse what is not theirs in one line that names it (exit 2, no traceback)."""
from __future__ import annotations

import gzip
import os
from pathlib import Path

from src.diagnose import main as diagnose_main
from src.export import main as export_main


def _error_line(capsys) -> str:
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    return lines[0]


def test_diagnose_says_random_bytes_are_not_an_nsight_compute_report(tmp_path: Path, capsys):
    noise = os.urandom(4096)
    (tmp_path / "x.ncu-rep").write_bytes(noise)
    assert diagnose_main([str(tmp_path / "x.ncu-rep"), "--out", str(tmp_path / "out")]) == 2
    assert "x.ncu-rep: not an Nsight Compute report (no NVR header)" in _error_line(capsys)
    (tmp_path / "y.ncu-rep.gz").write_bytes(noise)  # not gzip at all
    assert diagnose_main([str(tmp_path / "y.ncu-rep.gz"), "--out", str(tmp_path / "out")]) == 2
    assert "y.ncu-rep.gz: not an Nsight Compute report (not gzip data" in _error_line(capsys)
    (tmp_path / "z.ncu-rep.gz").write_bytes(gzip.compress(noise))  # gzip of something else
    assert diagnose_main([str(tmp_path / "z.ncu-rep.gz"), "--out", str(tmp_path / "out")]) == 2
    assert "not an Nsight Compute report" in _error_line(capsys)
    assert not (tmp_path / "out").exists()


def test_export_says_there_is_no_checkpoint_there(tmp_path: Path, capsys):
    assert export_main([str(tmp_path / "MISSING_DIR"), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "MISSING_DIR: no checkpoint there (no such folder)" in _error_line(capsys)
    run = tmp_path / "run"
    (run / "checkpoints" / "step_00000004").mkdir(parents=True)
    (run / "checkpoints" / "step_00000004" / ".metadata").write_bytes(b"")
    assert export_main([str(run / "checkpoints"), "--out", str(tmp_path / "m.safetensors")]) == 2
    assert "no checkpoint there (no DCP .metadata); the newest inside is" in _error_line(capsys)
    assert not (tmp_path / "m.safetensors").exists()
