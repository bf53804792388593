"""`python -m src.speed`: every recipe, what it replaces, the releases it was verified on, and
whether it may run on the torch installed here (its probe run now). `--markdown` prints the same
as a table for docs; `--symbols` adds every symbol each recipe reads. Exits 1 where a recipe's
probe finds a symbol missing or changed on this torch."""
from __future__ import annotations

import argparse
import sys

from src.speed import RECIPES
from src.speed.versions import torch_version, triton_version


def _short(symbol: str) -> str:
    return symbol.rpartition(":")[2]


def rows(symbols: bool) -> list[list[str]]:
    out = []
    for recipe in RECIPES.values():
        why, native = recipe.why_not(), recipe.native()
        here = f"torch's own instead: {native}" if native else "runs" if why is None else why
        touched = ", ".join(_short(s) for s in recipe.replaces)
        if symbols:
            touched += "; reads " + ", ".join(_short(s) for s in recipe.reads)
        out.append([recipe.knob, touched, ", ".join(recipe.torch), ", ".join(recipe.triton) or "-", here, recipe.gain, recipe.parity])
    return out


def _print_blocks(header: list[str], table: list[list[str]]) -> None:
    """A block per recipe, its knob whole on the first line and each field wrapped under it: a
    seven-column table cut the knobs' names to `speed.g…` at 80 columns."""
    from rich.console import Console
    from rich.markup import escape
    from rich.padding import Padding

    console = Console(highlight=False)
    console.print(f"speed recipes (src/speed/), {header[4]}:")
    for knob, touched, torch_ok, triton_ok, here, gain, parity in table:
        console.print(f"[bold]{escape(knob)}[/bold]: {escape(here)}")
        # the parity test's file: its test's name (the Markdown table has it) would break mid-word
        fields = (("replaces", touched), ("verified", f"torch {torch_ok}; Triton {triton_ok}"), ("gain", gain), ("parity", parity.split("::")[0]))
        for label, value in fields:
            console.print(Padding(f"{label}: {escape(value)}", (0, 0, 0, 2)))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.speed", description=__doc__.split("\n\n")[0])
    parser.add_argument("--markdown", action="store_true", help="a Markdown table")
    parser.add_argument("--symbols", action="store_true", help="every torch symbol each recipe reads, too")
    args = parser.parse_args(argv)
    header = ["knob", "replaces", "torch verified", "Triton verified", f"on torch {torch_version()}, Triton {triton_version() or 'missing'}",
              "gain", "parity test"]
    table = rows(args.symbols)
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in table:
            print("| " + " | ".join(f"`{row[0]}`" if i == 0 else c for i, c in enumerate(row)) + " |")
    else:
        _print_blocks(header, table)
    broken = False
    for recipe in RECIPES.values():
        for gap in recipe.probe():
            print(f"{recipe.knob}: {gap}", file=sys.stderr)
            broken = True
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
