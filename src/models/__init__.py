"""Plain nn.Modules, one folder per architecture (src/models/ARCH/: config.py, model.py, checks.py,
hf.py where it reads Hugging Face folders, architecture.py naming them), each behind the contract in
protocol.py: constructor arguments only, never the config object (build_model is the boundary).

Importing this package imports no torch: src/config/ reads each architecture's config.py from it
for `--help`. build_model, meta_model and ARCHS come from registry.py on first use.
"""
from __future__ import annotations

_LAZY = {"ARCHS", "Architecture", "build_model", "meta_model", "architecture"}


def __getattr__(name: str):
    if name in _LAZY:
        from src.models import registry

        return getattr(registry, name)
    raise AttributeError(f"module 'src.models' has no attribute {name!r}")
