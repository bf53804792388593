"""`python -m src.run --help` and `--cfg job` print from the config alone: they import no torch,
which was most of their time (src/run.py imports the tasks' modules where a job runs)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from src.config.help import COMMON
from tests.support.cli import REPO

# src.run as `python -m src.run` runs it, then whether torch was imported. Hydra ends --help and
# --cfg with SystemExit(0); any other exit code is the command's failure.
_PROBE = """\
import runpy, sys
sys.argv = ['src.run', *sys.argv[1:]]
try:
    runpy.run_module('src.run', run_name='__main__', alter_sys=True)
except SystemExit as done:
    if done.code not in (0, None):
        raise
print('torch imported:', 'torch' in sys.modules)
"""


def _inspect(args: list[str], cwd: Path) -> list[str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))}
    proc = subprocess.run([sys.executable, "-c", _PROBE, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.splitlines()


@pytest.mark.parametrize("flag", ["--help", "--hydra-help"])
def test_help_imports_no_torch_and_lists_the_config_groups(tmp_path: Path, flag: str):
    lines = _inspect([flag], tmp_path)
    assert lines[-1] == "torch imported: False"
    if flag == "--help":
        groups = sorted(p.name for p in (REPO / "conf").iterdir() if p.is_dir() and p.name != "hydra")
        for group in groups:
            assert any(line.startswith(f"{group}: ") for line in lines), group
        # the short listing: the common settings (src/config/help.py COMMON), then how to see them all
        for key in COMMON:
            assert any(line.startswith(f"  {key}=") for line in lines), key
        assert not any(line.startswith("  model.dim=") for line in lines) and len(lines) < 100
        assert any("--help hydra/help=all" in line for line in lines)
    else:  # Hydra's own groups, listed by Hydra
        assert any(line.startswith("hydra/launcher: ") and "submitit_slurm" in line for line in lines)
    assert list(tmp_path.iterdir()) == []


def test_cfg_job_imports_no_torch(tmp_path: Path):
    lines = _inspect(["--cfg", "job", "model=mini_llm"], tmp_path)
    assert lines[-1] == "torch imported: False"
    assert "model:" in lines and "  name: mini_llm" in lines
    assert list(tmp_path.iterdir()) == []


def test_the_common_settings_are_fields_of_the_schemas():
    """A setting retired from the schemas leaves COMMON too (the short --help would show it as null)."""
    import dataclasses

    from src.config.help import _sections

    schemas = dict(_sections())
    for key in COMMON:
        section, _, name = key.partition(".")
        assert name in {f.name for f in dataclasses.fields(schemas[section])}, key
    assert len(set(COMMON)) == len(COMMON) == 20
