"""Which `--iree-vulkan-target` names the installed IREE compiler resolves, asked of the compiler.

src/edge/targets.py passes any sm_XX or gfxNNNN name, and the names IREE resolves change from one
release to the next: 3.13 knows sm_89 but not sm_90 (Hopper) nor sm_100, and given one of
those, iree-compile prints "Unknown Vulkan target" and crashes (SIGSEGV in its VerifyDevices pass)
after the run's folder and MLflow run exist. So the compiler is asked before anything starts: an
empty module compiled to the `preprocessing` phase resolves the target and generates no code, a
small fraction of a second a name (with the crash's stack dump left unsymbolised, which would take
ten times as long).
"""
from __future__ import annotations

import functools
import os
import subprocess
import tempfile
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from src.edge.targets import VULKAN_TARGETS

# The LLVM-style names IREE's target table (KnownTargets.cpp) has listed for Vulkan in recent
# releases; the installed compiler says which of them, and of VULKAN_TARGETS, it resolves.
LLVM_STYLE_CANDIDATES = (
    "sm_60", "sm_61", "sm_62", "sm_70", "sm_72", "sm_75", "sm_80", "sm_86", "sm_87", "sm_89", "sm_90", "sm_100", "sm_120",
    "gfx908", "gfx90a", "gfx942", "gfx950", "gfx1010", "gfx1030", "gfx1100", "gfx1101", "gfx1102", "gfx1103", "gfx1150",
    "gfx1151", "gfx1200", "gfx1201",
)
PROBE_TIMEOUT_S = 60  # a name takes a fraction of a second; a minute is a compiler that hangs, not one that is slow


def _compiler() -> str | None:
    try:
        from iree.compiler.tools.binaries import find_tool

        return find_tool("iree-compile")
    except Exception:  # no compiler installed, or a layout find_tool does not know
        return None


def compiler_version() -> str:
    from src.runtime import installed_version

    return installed_version("iree-base-compiler") or "(version unknown)"


@functools.cache
def resolves(target: str) -> bool | None:
    """Whether the installed iree-compile resolves `--iree-vulkan-target=target`; None where it
    could not be asked (no compiler, a timeout, another failure): the compile then says."""
    tool = _compiler()
    if tool is None:
        return None
    with tempfile.TemporaryDirectory(prefix="perflab_iree_target_") as folder:
        empty = Path(folder) / "empty.mlir"
        empty.write_text("module {}\n")
        cmd = [tool, "--iree-hal-target-device=vulkan", f"--iree-vulkan-target={target}", "--compile-to=preprocessing",
               str(empty), "-o", str(Path(folder) / "out.mlir")]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=PROBE_TIMEOUT_S,
                                  env={**os.environ, "LLVM_DISABLE_SYMBOLIZATION": "1"})
        except (OSError, subprocess.TimeoutExpired):
            return None
    if proc.returncode == 0:
        return True
    return False if "Unknown Vulkan target" in proc.stderr else None


def known_names() -> list[str]:
    """Of VULKAN_TARGETS and LLVM_STYLE_CANDIDATES, the names the installed compiler resolves."""
    names = [*VULKAN_TARGETS, *LLVM_STYLE_CANDIDATES]
    with ThreadPoolExecutor(max_workers=min(4, os.cpu_count() or 1)) as pool:
        answers = list(pool.map(resolves, names))
    return [name for name, ok in zip(names, answers, strict=True) if ok]
