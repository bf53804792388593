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
        from rich.console import Console
        from rich.table import Table

        t = Table(*header, title="speed recipes (src/speed/)", show_lines=True)
        for row in table:
            t.add_row(*row)
        Console().print(t)
    broken = False
    for recipe in RECIPES.values():
        for gap in recipe.probe():
            print(f"{recipe.knob}: {gap}", file=sys.stderr)
            broken = True
    return 1 if broken else 0


if __name__ == "__main__":
    sys.exit(main())
