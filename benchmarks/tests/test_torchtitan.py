"""benchmarks/torchtitan_llama.py without a GPU or torchtitan: its 1B flavor is our llama3_1b's shape
(parameters and FLOPs a token counted both ways), its parser reads torchtitan 0.2.2's step lines, and
its tokenizer covers every byte."""
from __future__ import annotations

import json

import pytest
import torch

from benchmarks.torchtitan_flavor import FLAVORS, ffn_hidden, flops_per_token, param_count
from benchmarks.torchtitan_llama import main, parse_titan_log, table, titan_figures, write_assets
from src.models.llama3.model import Llama3


def _ours(shape: dict, tied: bool) -> Llama3:
    with torch.device("meta"):
        return Llama3(vocab_size=shape["vocab_size"], dim=shape["dim"], n_layers=shape["n_layers"], n_heads=shape["n_heads"],
                      n_kv_heads=shape["n_kv_heads"], ffn_hidden=ffn_hidden(shape), rope_factor=shape["rope_factor"],
                      tie_embeddings=tied)


@pytest.mark.parametrize("tied", [False, True])
def test_flavor_is_llama3_1b(tied):
    shape = FLAVORS["1B"]
    assert ffn_hidden(shape) == 8192  # conf/model/llama3_1b.yaml's ffn_hidden
    ours = _ours(shape, tied)
    assert param_count(shape, tied) == ours.num_params(non_embedding=False)
    assert flops_per_token(shape, 2048, tied) == ours.flops_per_token(2048)
    # LLaMA 3.2 1B's published 1.24B (tied); torchtitan's untied model adds the 128256 x 2048 head
    assert param_count(shape, tied) == (1_235_814_400 if tied else 1_498_482_688)


def test_flavor_smoke_count_matches_torchtitans_log():
    # "Model llama3 1B_smoke size: 67,634,432 total parameters", torchtitan 0.2.2 on a CPU
    assert param_count(FLAVORS["1B_smoke"]) == 67_634_432


# MetricsProcessor.log's format in torchtitan 0.2.2, with and without its colour codes
LOG = """[titan] 2026-12-05 04:26:10,044 - root - INFO - \x1b[34mModel llama3 1B \x1b[31msize: 1,498,482,688 total parameters\x1b[39m
[titan] 2026-12-05 04:26:13,740 - root - INFO - \x1b[31mstep:  1  \x1b[32mloss: 12.52266  \x1b[33mgrad_norm:  2.6413  \x1b[38;2;54;234;195mmemory: 40.00GiB(28.62%)  \x1b[34mtps: 9,000  \x1b[36mtflops: 74.00  \x1b[35mmfu: 7.48%\x1b[39m
[titan] 2026-12-05 04:26:14,740 - root - INFO - step:  2  loss: 12.10000  grad_norm:  1.9018  memory: 41.00GiB(29.34%)  tps: 50,000  tflops: 411.01  mfu: 41.56%
[titan] 2026-12-05 04:26:15,740 - root - INFO - step:  3  loss: 11.90000  grad_norm:  1.9209  memory: 41.00GiB(29.34%)  tps: 52,000  tflops: 427.45  mfu: 43.22%
[titan] 2026-12-05 04:26:16,740 - root - INFO - step:  4  loss: 11.80000  grad_norm:  1.9823  memory: 41.00GiB(29.34%)  tps: 51,000  tflops: 419.23  mfu: 42.39%
"""


def test_parse_titan_log():
    steps, size = parse_titan_log(LOG)
    assert size == 1_498_482_688
    assert [s["step"] for s in steps] == [1, 2, 3, 4]
    assert steps[0] == {"step": 1, "loss": 12.52266, "grad_norm": 2.6413, "mem_gib": 40.0, "tps": 9000.0, "tflops": 74.0, "mfu": 7.48}
    fpt = flops_per_token(FLAVORS["1B"], 2048)
    fig = titan_figures(steps, warmup=1, tokens_per_step=4 * 2048, fpt=fpt)
    assert fig["tokens_per_s_per_device"] == 51_000 and fig["mfu_titan"] == 42.39
    assert fig["step_time_s"] == pytest.approx(8192 / 51_000)
    assert fig["peak_mem_gb"] == pytest.approx(41 * 2**30 / 1e9)
    # our formula at 989 TFLOP/s agrees with torchtitan's own figure for the untied model
    assert fig["mfu"] == pytest.approx(42.39, abs=0.01)


def test_assets_and_dry_run(tmp_path, capsys):
    tok, data = write_assets(tmp_path / "assets", corpus_mb=0.05)
    vocab = json.loads((tok / "vocab.json").read_text())
    assert sorted(vocab.values()) == list(range(256)) and all(len(ch) == 1 for ch in vocab)
    docs = [json.loads(line)["text"] for line in (data / "train.jsonl").read_text().splitlines()]
    assert sum(map(len, docs)) > 40_000
    main(["--dry-run", "--corpus-mb", "0.05", "--out", str(tmp_path), "--titan-settings", "eager,compile_fp8"])
    out = capsys.readouterr().out
    assert "--model.flavor 1B" in out and "--experimental.custom_import benchmarks.torchtitan_flavor" in out
    assert "quantize.linear.float8" in out and "model.tie_embeddings=false" in out


def _row(run: str, whose: str, n: int, tps: float) -> dict:
    return {"run": run, "whose": whose, "round": n, "tokens_per_s_per_device": tps, "step_time_s": 8192 / tps, "mfu": None}


def test_rounds_compare_each_of_ours_with_its_own_rounds_torchtitan():
    rows = [_row("compile_fp8", "torchtitan", 1, 60_000), _row("fp8_tied", "ours", 1, 78_000),
            _row("compile_fp8", "torchtitan", 2, 59_000), _row("fp8_tied", "ours", 2, 77_000),
            {"run": "compile", "whose": "torchtitan", "round": 2, "error": "timed out\nlast lines"}]
    text = table(rows)
    assert "| 1 | fp8_tied | ours | 78,000 |" in text and "| 1.300x |" in text  # 78k / round 1's 60k
    assert "| 2 | fp8_tied | ours | 77,000 |" in text and "| 1.305x |" in text  # 77k / round 2's 59k, not round 1's
    assert "| 2 | compile | torchtitan | failed: timed out |" in text
    assert "fp8_tied: 1.300x-1.305x torchtitan's best over 2 rounds" in text
    one = table([r for r in rows if r["round"] == 1])  # one round: no round column, no range
    assert one.startswith("| run | whose |") and "over 1 rounds" not in one and "| 1.300x |" in one


def test_a_dry_run_of_two_rounds_lists_the_plan_twice(tmp_path, capsys):
    main(["--dry-run", "--rounds", "2", "--corpus-mb", "0.05", "--out", str(tmp_path), "--titan-settings", "compile_fp8",
          "--ours", "fp8_tied=+exp=llama3_1b_fp8"])
    out = capsys.readouterr().out
    assert out.count("# torchtitan compile_fp8") == 2 and out.count("# ours fp8_tied") == 2
    assert out.index("# ours fp8_tied") < out.rindex("# torchtitan compile_fp8")  # alternated: round 1 whole, then round 2
