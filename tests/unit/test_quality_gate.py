"""A sweep's best is a run within its quality bound: an edge run whose perplexity rose over fp32's by
more than its edge.quality_tolerance is left out of the ranking (src/edge/__init__.py's rule, read by
src/tracking/figures.py's best_row), and the sweep and compare say which and why."""
from __future__ import annotations

import io

from rich.console import Console

import src.edge  # noqa: F401  (declares task=infer's figures and its rule)
from src.compare import render
from src.tracking.figures import best_row, left_out


def _row(run: str, tok_s: float, rise: float | None, status: str = "finished") -> dict:
    return {"run": run, "task": "infer", "status": status, "decode_tokens_per_s": tok_s, "perplexity_increase": rise,
            "quality_tolerance": 0.05, "rel_err": 1e-3}


ROWS = [_row("edge.quant=none", 100.0, 0.0), _row("edge.quant=int8", 130.0, 0.004), _row("edge.quant=int4", 160.0, 0.21),
        _row("edge.quant=int4 edge.quant_group=128", 170.0, None, status="failed")]


def test_the_fastest_run_past_the_bound_is_not_the_best_and_says_why():
    assert best_row(ROWS, "decode_tokens_per_s")["run"] == "edge.quant=int8"
    assert list(left_out(ROWS).values()) == ["perplexity +21.0% over fp32, past edge.quality_tolerance=0.05"]
    unmeasured = [_row("a", 1.0, None), _row("b", 2.0, None)]  # no perplexity: nothing to hold against a run
    assert best_row(unmeasured, "decode_tokens_per_s")["run"] == "b" and left_out(unmeasured) == {}


def test_compare_stars_the_best_within_the_bound_and_names_the_run_left_out():
    out = io.StringIO()
    render(ROWS, None, Console(file=out, width=80, force_terminal=False, color_system=None))
    text = out.getvalue()
    lines = text.splitlines()
    assert max(map(len, lines)) <= 80
    star = [line for line in lines if "★" in line]
    assert len(star) == 1 and "int8" in star[0]
    assert "not ranked: edge.quant=int4: perplexity +21.0% over fp32, past edge.quality_tolerance=0.05" in " ".join(text.split())
    assert "ppl rise" in text and "0.21" in text  # the rise is a column
