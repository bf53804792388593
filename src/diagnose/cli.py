"""`python -m src.diagnose REPORT [--out DIR]`: diagnose an existing Nsight Compute report.

REPORT is an `.ncu-rep` (optionally gzipped) or its `ncu --import REPORT --csv --page raw` export.
Writes DIR/diagnosis.json, DIR/roofline.png and DIR/top_ops.md, and prints the top-ops table.
"""
from __future__ import annotations

import argparse
import json
import sys
from dataclasses import fields
from pathlib import Path
from typing import Any

from src.profiling.classify import Thresholds
from src.profiling.diagnosis import diagnose, top_ops_table
from src.profiling.ncu_reader import read_report
from src.profiling.roofline import plot_roofline


def diagnose_report(report: str | Path, out_dir: str | Path, thresholds: Thresholds = Thresholds(), unranged: str = "") -> dict[str, Any]:
    records = read_report(report)
    if not records:
        raise ValueError(f"{report}: the report holds no kernels")
    result = diagnose(records, thresholds, source=str(report), unranged=unranged)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "diagnosis.json").write_text(json.dumps(result, indent=2, default=str))
    (out / "top_ops.md").write_text(top_ops_table(result) + "\n")
    plot_roofline(result, out / "roofline.png")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m src.diagnose", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("report", help=".ncu-rep, .ncu-rep.gz, or a --csv --page raw export")
    ap.add_argument("--out", default=".", help="where diagnosis.json, roofline.png and top_ops.md go (default: here)")
    ap.add_argument("--unranged", default="", help="module name for kernels launched outside any NVTX range (e.g. backward)")
    for f in fields(Thresholds):
        ap.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default)
    args = ap.parse_args(argv)
    thresholds = Thresholds(**{f.name: getattr(args, f.name) for f in fields(Thresholds)})
    try:
        result = diagnose_report(args.report, args.out, thresholds, args.unranged)
    except (OSError, ValueError, ImportError) as err:
        sys.stderr.write(f"error: {err}\n")
        return 2
    print(top_ops_table(result))
    print(f"\n{result['kernel_count']} kernels, {1e3 * result['total_kernel_time_s']:.3f} ms; "
          f"memory-bound {100 * result['share_memory_bound']:.1f}% of kernel time -> {Path(args.out) / 'diagnosis.json'}")
    return 0

