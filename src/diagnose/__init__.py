"""task=diagnose and `python -m src.diagnose REPORT`: Nsight Compute over one training step, and the
verdicts read from its report (the reading itself is src/profiling/'s).

cli.py: diagnose an existing report; task.py: task=diagnose (ncu over the step, then the
diagnosis); target.py: the process ncu profiles.
"""
from __future__ import annotations

from src.tracking.figures import register_figures

# task=diagnose's figures, the headline first
register_figures("diagnose", ("share_memory_bound",), extra=("device_name",))


def main(argv: list[str] | None = None) -> int:
    """`python -m src.diagnose`: here so that importing the task does not import the CLI."""
    from src.diagnose.cli import main as cli_main

    return cli_main(argv)
