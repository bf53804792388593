"""Imports that run from a lower layer to a higher one (README's layout section): every `import`
and `from ... import` in kernels/ and src/, at module level or inside a function. Prints one line
per upward import and exits 1 when there are more than ALLOWED of them.

    python .ci/layers.py
"""
from __future__ import annotations

import ast
import fnmatch
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# lowest first; a module belongs to the longest prefix that names it
LAYERS: list[tuple[str, ...]] = [
    ("perflab_kernels",),
    ("src.dtypes", "src.runtime", "src.config", "src.fusion.ops", "src.models.config", "src.models.*.config"),
    ("src.models", "src.data"),
    ("src.distributed", "src.speed", "src.fusion", "src.profiling", "src.tracking"),
    ("src.train", "src.edge", "src.kernel_bench", "src.diagnose"),
    ("src.tasks", "src.run", "src.config.validate", "src.compare", "src.export", "src"),
]
ALLOWED = 1  # "at most one import runs from a lower layer to a higher one"


def layer(module: str) -> int | None:
    best, found = -1, None
    for i, prefixes in enumerate(LAYERS):
        for p in prefixes:
            # `src.models.*.config`: each architecture's config, which the config layer registers
            if (fnmatch.fnmatchcase(module, p) or module.startswith(p + ".")) and len(p) > best:
                best, found = len(p), i
    return found


# import names whose folder is named otherwise (pyproject.toml's package-dir)
PACKAGE_DIRS = {"perflab_kernels": "kernels"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    folders = {folder: name for name, folder in PACKAGE_DIRS.items()}
    return ".".join([folders.get(parts[0], parts[0]), *parts[1:]])


def is_module(name: str) -> bool:
    top, *rest = name.split(".")
    path = ROOT.joinpath(PACKAGE_DIRS.get(top, top), *rest)
    return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()


def imports(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(), str(path))
    package = module_name(path) if path.name == "__init__.py" else module_name(path).rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, base] if base else anchor)
            # `from src import config`: the module imported is src.config
            found += [(node.lineno, f"{base}.{a.name}" if is_module(f"{base}.{a.name}") else base) for a in node.names]
    return sorted(set(found))


def upward() -> list[str]:
    lines = []
    for path in sorted([*ROOT.glob("src/**/*.py"), *ROOT.glob("kernels/**/*.py")]):
        here = module_name(path)
        mine = layer(here)
        for lineno, target in imports(path):
            theirs = layer(target)
            if mine is not None and theirs is not None and theirs > mine:
                lines.append(f"{path.relative_to(ROOT)}:{lineno}: {here} (layer {mine}) imports {target} (layer {theirs})")
    return lines


if __name__ == "__main__":
    found = upward()
    print("\n".join(found) or "no upward imports")
    sys.exit(1 if len(found) > ALLOWED else 0)
