"""Report reader, bound classifier, diagnosis and roofline on real H200 captures (tests/fixtures/ncu)."""
from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from src.diagnose import main as diagnose_cli
from src.profiling.categories import classify_op
from src.profiling.classify import Thresholds, classify
from src.profiling.diagnosis import SCHEMA, diagnose, fusable_ops, module_of
from src.profiling.ncu_reader import read_report, to_base_unit

# The real captures travel with the project (tests/fixtures/ncu/README.md says how each was made).
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "ncu"
REP, REP_CSV, METRICS_CSV = FIXTURES / "h200_ops.ncu-rep.gz", FIXTURES / "h200_ops_raw.csv", FIXTURES / "h200_targets_metrics_raw.csv"
OPS = ["rms_norm", "copy", "softmax", "silu", "mul", "gemm"]  # workload.py's order inside the NVTX range "ops"



@pytest.fixture(scope="module")
def rep_records():
    pytest.importorskip("ncu_report")
    return read_report(REP)


def test_csv_export_parses_past_the_preamble_units_and_separators():
    records = read_report(METRICS_CSV)
    assert len(records) == 18  # 6 random fills, then the 6 ops twice
    gemm = records[11]
    assert classify_op(gemm.name) == ("gemm", "gemm") and gemm.short_name.startswith("nvjet_sm90")
    assert gemm.sm_pct == pytest.approx(93.51) and gemm.dram_pct == pytest.approx(20.7, abs=0.1)
    assert gemm.duration_s == pytest.approx(1.387648e-3)  # "1,387,648" ns
    assert gemm.dram_bytes == pytest.approx(1_381_197_312)  # dram__bytes.sum, thousands separators gone
    assert records[0].device == "NVIDIA H200"


def test_ncu_rep_and_its_csv_export_agree(rep_records):
    csv_records = read_report(REP_CSV)
    assert [classify_op(r.name)[0] for r in rep_records] == OPS == [classify_op(r.name)[0] for r in csv_records]
    for a, b in zip(rep_records, csv_records):
        assert a.nvtx == b.nvtx == ["ops"]
        assert a.sm_pct == pytest.approx(b.sm_pct, rel=1e-5) and a.dram_pct == pytest.approx(b.dram_pct, rel=1e-5)
        assert a.duration_s == pytest.approx(b.duration_s, rel=1e-5)  # ns in the report, ms in the export
        assert a.dram_bytes == pytest.approx(b.dram_bytes, rel=1e-5)  # dram__bytes.sum.per_second x duration
        assert (a.fp32_flops or 0) == pytest.approx(b.fp32_flops or 0, rel=1e-5)


def test_classifier_labels_the_captured_kernels(rep_records):
    verdicts = {classify_op(r.name)[0]: classify(r.sm_pct, r.dram_pct, r.occupancy_pct) for r in rep_records}
    assert verdicts["gemm"].bound == "compute-bound" and verdicts["gemm"].textbook
    assert verdicts["mul"].bound == "memory-bound" and verdicts["mul"].textbook
    # silu reads SM 74% / HBM 77%: not docs/SEED.md's textbook pair, but HBM is the unit at its limit
    assert verdicts["silu"].bound == "memory-bound" and not verdicts["silu"].textbook
    for op in ("rms_norm", "softmax", "copy"):
        assert verdicts[op].bound == "neither", op
    assert "fusion" in verdicts["mul"].remedy and "FP8" in verdicts["gemm"].remedy


def test_the_l1_l2_memory_row_is_not_used_for_the_verdict(rep_records):
    gemm = next(r for r in rep_records if classify_op(r.name)[0] == "gemm")
    assert gemm.mem_pct > 90 and gemm.dram_pct < 25  # "Memory Throughput" 94% on a compute-bound GEMM


def test_thresholds_come_from_config():
    assert classify(74, 77).bound == "memory-bound"
    # idle SMs with HBM doing most of the work: AdamW's multi_tensor_apply on mini_llm reads 19 / 70
    assert classify(19, 70).bound == "memory-bound" and not classify(19, 70).textbook
    assert classify(38, 57).bound == "neither" and classify(24, 44).bound == "neither"
    assert classify(74, 77, t=Thresholds(hbm_bound_pct=80)).bound == "neither"
    assert classify(10, 30, occupancy_pct=20).limiter == "occupancy"
    assert math.isnan(to_base_unit(math.nan, "ms")) and to_base_unit(2, "Tbyte/s") == 2e12 and to_base_unit(3, "ms") == 3e-3


def test_diagnosis_shares_and_fusion_targets(rep_records):
    d = diagnose(rep_records, source=str(REP))
    assert d["schema"] == SCHEMA and d["kernel_count"] == 6 and d["device"] == "NVIDIA H200"
    by_op = {o["op"]: o for o in d["ops"]}
    assert sum(o["share"] for o in d["ops"]) == pytest.approx(1.0)
    assert d["ops"][0]["op"] == "gemm"  # the costliest first
    assert d["share_memory_bound"] == pytest.approx(by_op["silu"]["share"] + by_op["mul"]["share"])
    # no backward kernels in this capture: a share is of what was profiled, and it says so
    assert not d["has_backward"] and "no backward" in d["share_of"]
    assert by_op["mul"]["summary"] == "ops/mul: memory-bound (margin 8.8 pts), 6.7% of profiled kernels -> fused Triton SiLU-mul"
    assert by_op["gemm"]["fusion"] is None
    # tensor-pipe FLOPs: the 8192^3 bf16 GEMM (1.10 TFLOP in 1.37 ms) sits near the bf16 tensor roof
    (gemm,) = [k for k in d["kernels"] if k["op"] == "gemm"]
    assert gemm["tensor_flops"] == pytest.approx(2 * 8192**3, rel=0.05)
    assert 700e12 < gemm["achieved_flops"] < 989e12
    assert all(not k["tensor_flops"] for k in d["kernels"] if k["op"] != "gemm")
    fuse = fusable_ops(d)
    assert set(fuse["swiglu"]) == {by_op["silu"]["summary"], by_op["mul"]["summary"]}
    assert "rms_norm" in fuse and "softmax" in fuse  # latency-limited: fusing them still removes launches


def test_module_names_fold_layer_indices():
    assert module_of(["step", "fwd/layers.11.ffn"]) == "layers.*.ffn"
    assert module_of(["step", "fwd/layers.3.attn.out_proj"]) == "layers.*.attn.out_proj"
    assert module_of(["step", "optimizer"]) == "optimizer" and module_of([]) == ""


@pytest.mark.parametrize("report", [REP_CSV, METRICS_CSV])
def test_cli_writes_diagnosis_roofline_and_table(tmp_path, capsys, report):
    assert diagnose_cli([str(report), "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "diagnosis.json").read_text())
    assert d["schema"] == SCHEMA and d["ops"]
    png = (tmp_path / "roofline.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 20_000
    assert "| op |" in capsys.readouterr().out and (tmp_path / "top_ops.md").read_text().count("\n") >= 3


def test_cli_names_a_missing_report(tmp_path, capsys):
    assert diagnose_cli([str(tmp_path / "nope.ncu-rep")]) == 2
    assert "no such report" in capsys.readouterr().err


def test_a_diagnosis_json_can_be_diagnosed_again(tmp_path):
    """mini_llm's step on one H200 (task=diagnose, 2026-11-30): 701 kernels kept in diagnosis.json."""
    source = Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json"
    d = diagnose(read_report(source), unranged="backward")
    assert d["kernel_count"] == 701
    by_key = {o["key"]: o for o in d["ops"]}
    assert by_key["backward/gemm"]["bound"] == "compute-bound" and by_key["layers.*.ffn/gemm"]["bound"] == "compute-bound"
    assert by_key["optimizer/adamw"]["bound"] == "memory-bound"
    assert by_key["loss/cross_entropy"]["fusion"] == "cross_entropy"
    assert by_key["layers.*.ffn/silu"]["fusion"] == "swiglu"
    assert 0.15 < d["share_memory_bound"] < 0.25
    assert "backward/other" not in by_key  # every backward kernel is named (GammaBeta -> norm, dot_do_o -> attention)
    assert d["has_backward"] and "% of step" in by_key["optimizer/adamw"]["summary"]
    # the optimizer's own remedy, not the generic memory-bound one
    assert by_key["optimizer/adamw"]["summary"].endswith("-> AdamW in one Triton launch, the grad norm read in its pass (optim.impl=triton; kernels=auto times it against torch's fused AdamW)")
    # one verdict per kernel name in a module: the same kernel in 12 layers never gets two
    verdicts = {}
    for k in d["kernels"]:
        verdicts.setdefault((k["name"], k["module"], k["op"]), set()).add(k["bound"])
    assert all(len(v) == 1 for v in verdicts.values())
    assert all(not math.isnan(o["margin_pct"]) for o in d["ops"])
    # a GEMM below the compute roof gets a GEMM's remedy, never "smaller blocks"
    for o in d["ops"]:
        if o["category"] == "gemm" and o["bound"] != "compute-bound":
            assert "more work per GEMM" in o["remedy"], o


def test_the_cli_on_a_diagnosis_json_keeps_the_device(tmp_path, capsys):
    source = Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json"
    assert diagnose_cli([str(source), "--out", str(tmp_path)]) == 0
    d = json.loads((tmp_path / "diagnosis.json").read_text())
    assert d["device"] == "NVIDIA H200" and d["has_backward"]


def test_the_table_explains_its_marks_with_the_thresholds_it_used():
    import json as _json

    from src.profiling.diagnosis import top_ops_table

    diagnosis = _json.loads((Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json").read_text())
    diagnosis["thresholds"] = {**diagnosis.get("thresholds", {}), "hbm_bound_pct": 70.0}
    table = top_ops_table(diagnosis, limit=3)
    assert "compute-bound *" in table  # the fixture's GEMMs read SM 92% / HBM 20%: textbook
    assert "`*`: a textbook verdict" in table and "memory-bound: HBM >= 70% and SM < 25%" in table
