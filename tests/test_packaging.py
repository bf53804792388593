"""What the installed package holds: the user's modules, never the lab (benchmarks/ and its notes)."""
from __future__ import annotations

import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

from tests.conftest import REPO


def test_the_wheel_ships_no_bench_module(tmp_path: Path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(REPO / name, tree / name)
    for name in ("src", "kernels", "hydra_plugins", "benchmarks"):
        shutil.copytree(REPO / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("perflab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"src", "kernels", "hydra_plugins"}, tops
    assert "src/run.py" in names and "kernels/triton/rms_norm.py" in names
    assert not [n for n in names if "bench" in n.split("/")[1:-1] or n.startswith("benchmarks/")], names
