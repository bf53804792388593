"""The packages, found rather than listed, so a new folder of src/ (an architecture under
src/models/, say) installs without an edit here; pyproject.toml holds everything else.

hydra_plugins is a namespace shared with Hydra's own launchers: only this project's are taken.
kernels/ is named by its import name, perflab_kernels (pyproject.toml's package-dir)."""
from setuptools import find_namespace_packages, find_packages, setup

setup(packages=[
    *find_packages(include=["src", "src.*"]),
    *find_namespace_packages(include=["hydra_plugins.perflab_*"]),
    "perflab_kernels", "perflab_kernels.triton",
])
