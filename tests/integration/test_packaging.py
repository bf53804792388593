"""What the installed package holds: the user's modules, never the lab (benchmarks/ and its notes)."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.support.cli import REPO


def test_the_wheel_ships_no_bench_module(tmp_path: Path):
    tree = tmp_path / "tree"
    tree.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy(REPO / name, tree / name)
    for name in ("src", "kernels", "hydra_plugins", "benchmarks"):
        shutil.copytree(REPO / name, tree / name, ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(tmp_path / "dist"), str(tree)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (wheel,) = (tmp_path / "dist").glob("perflab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"src", "perflab_kernels", "hydra_plugins"}, tops
    assert "src/run.py" in names and "perflab_kernels/triton/rms_norm.py" in names
    assert not [n for n in names if "bench" in n.split("/")[1:-1] or n.startswith("benchmarks/")], names
    # setup.py finds the packages (kernels/ installs under another name): none left out
    packages = {str(p.parent.relative_to(REPO)) for p in (REPO / "src").rglob("__init__.py")}
    assert {p for p in packages if f"{p}/__init__.py" not in names} == set()


def test_the_kernels_live_beside_hugging_faces_kernels_package(tmp_path: Path):
    """This project's kernels import as perflab_kernels; `kernels` stays Hugging Face's (a transformers
    dependency), from the repository's root as from anywhere else."""
    import importlib.metadata

    pytest.importorskip("transformers")
    try:
        hf = importlib.metadata.distribution("kernels")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("Hugging Face's kernels package is not installed")
    code = ("import kernels, perflab_kernels.triton.rms_norm as ours; from transformers import LlamaForCausalLM; "
            "print(kernels.__file__); print(ours.__file__)")
    for cwd in (REPO, tmp_path):
        proc = subprocess.run([sys.executable, "-c", code], cwd=cwd, capture_output=True, text=True, timeout=300,
                              env={**os.environ, "PYTHONPATH": str(REPO)})
        assert proc.returncode == 0, proc.stderr[-2000:]
        theirs, ours = proc.stdout.split()[-2:]
        assert Path(theirs).is_relative_to(Path(hf.locate_file(""))) and Path(ours) == REPO / "kernels" / "triton" / "rms_norm.py"
