"""benchmarks.fsdp_vs_seed: variants side by side with the seed, rows.json after every run, the
wall-clock budget, failures recorded; one real variant run of +exp=fsdp4 on a CPU; the fp8 loss gap."""
from __future__ import annotations

import json

import pytest

from benchmarks import fsdp_vs_seed as bench
from benchmarks.fp8_loss import compare

FIGS = {"mfu": 40.0, "peak_mem_gb": 30.0, "step_time_s": 0.08, "final_loss": 10.4, "host_rss_growth_mb": 1.0}


def test_variants_alternate_with_the_seed_and_each_row_is_saved_as_it_runs(tmp_path, monkeypatch, capsys):
    clock = [0.0]
    seen = []

    def fake_seed(nproc, args, compile_blocks, timeout):
        clock[0] += 60
        seen.append("seed+compile" if compile_blocks else "seed")
        return {"tokens_per_s_per_device": 100.0 if not compile_blocks else 106.0, **FIGS}

    def fake_ours(nproc, args, overrides, run_dir, timeout):
        clock[0] += 100
        seen.append(run_dir.name)
        assert len(json.loads((tmp_path / "rows.json").read_text())) == len(seen) - 1  # every earlier run already saved
        if overrides == ["precision=fp8"]:
            return {"error": "error: precision=fp8 needs compute capability 8.9+"}
        return {"tokens_per_s_per_device": 120.0, **FIGS, "gpu_sm_clock_mhz": 1605.0, "gpu_power_w": 692.0, "gpu_power_capped_frac": 0.98}

    monkeypatch.setattr(bench, "run_seed", fake_seed)
    monkeypatch.setattr(bench, "run_ours", fake_ours)
    rows = bench.main(["--nproc", "2", "--rounds", "3", "--seed-compile", "--budget-s", "700", "--out", str(tmp_path),
                       "--variant", "eager=", "--variant", "fp8=precision=fp8"], clock=lambda: clock[0])
    # round 0: seed 60 + seed+compile 60 + eager 100 + fp8 100 = 320 s; round 1 ends at 640 s; no run of 100 s fits after
    assert seen == ["seed", "seed+compile", "eager-n2-r0", "fp8-n2-r0", "seed", "seed+compile", "eager-n2-r1", "fp8-n2-r1"]
    saved = json.loads((tmp_path / "rows.json").read_text())
    assert saved == rows and len(rows) == 8 and rows[3]["error"].startswith("error: precision=fp8")
    out = capsys.readouterr().out
    assert "--budget-s 700: no new run after 640 s (8 runs)" in out
    header, *lines = (tmp_path / "table.txt").read_text().splitlines()
    assert header.split()[:2] == ["impl", "GPUs"] and "MFU %" in header and "RSS +MB" in header
    assert "SM MHz" in header and "SM 1605 MHz at 692 W (power cap 98% of samples)" in out
    by_impl = {line.split()[0]: line for line in lines}
    assert by_impl["seed+compile"].split()[-2] == "1.060x" and by_impl["eager"].split()[-2] == "1.200x"
    assert by_impl["eager"].split()[-4] == "1605" and by_impl["seed"].split()[-4] == "n/a"  # the seed's script does not sample
    assert "failed: error: precision=fp8" in by_impl["fp8"]


def test_a_variant_runs_the_experiment_with_its_overrides_on_a_cpu(tmp_path):
    import argparse

    args = argparse.Namespace(steps=3, warmup=1, out=tmp_path)
    # an upper-case KEY=VALUE goes to the run's environment, not to Hydra (which would refuse it as an unknown key)
    fig = bench.run_ours(1, args, ["backend=cpu", "model=tiny", "data.seq_len=32", "data.batch_size=2", "TORCH_CPP_LOG_LEVEL=ERROR"],
                         tmp_path / "cpu-n1-r0", timeout=300)
    assert set(fig) == set(bench.FIGURES) and fig["tokens_per_s_per_device"] > 0 and fig["host_rss_growth_mb"] is not None
    # a variant that names an experiment runs it instead of fsdp4
    tuned = bench.run_ours(1, args, ["+exp=fsdp4_tuned", "backend=cpu", "model=tiny", "data.seq_len=32", "data.batch_size=2",
                                     "kernels=eager", "kernels.fused=[]"], tmp_path / "tuned-n1-r0", timeout=300)
    assert tuned["tokens_per_s_per_device"] > 0
    settings = json.loads((tmp_path / "tuned-n1-r0" / "summary.json").read_text())["settings"]
    assert settings["exp"] == "fsdp4_tuned"
    bad = bench.run_ours(1, args, ["backend=cpu", "model=tiny", "optim.lr=-1"], tmp_path / "bad", timeout=300)
    assert bad == {"error": "error: optim.lr=-1.0: must be a positive finite learning rate, e.g. optim.lr=3e-4"}


def test_variant_names_and_the_fp8_loss_gap():
    assert bench.parse_variant('fp8=precision=fp8 "kernels=compile"') == ("fp8", ["precision=fp8", "kernels=compile"])
    assert bench.parse_variant("eager=") == ("eager", [])
    for bad in ("nameless", "=x", "seed2=x"):
        with pytest.raises(Exception, match="NAME=OVERRIDES"):
            bench.parse_variant(bad)
    gap = compare([3.0, 2.5, 2.4, 2.3], [3.1, 2.6, 2.43, 2.28], last=2)
    assert gap["steps_compared"] == 2 and gap["max_abs_gap"] == pytest.approx(0.03) and gap["mean_gap"] == pytest.approx(0.005)
    # curves: single steps far apart (+-0.2, batch to batch) that average out over the window
    bf16 = [2.0] * 8
    fp8 = [2.2, 1.8, 2.2, 1.8, 2.2, 1.8, 2.2, 1.8]
    curve = compare(bf16, fp8, last=4, window=2)
    assert curve["steps_compared"] == 4 and curve["max_abs_gap"] == pytest.approx(0.0, abs=1e-9)
    assert curve["max_abs_step_gap"] == pytest.approx(0.2) and curve["window"] == 2
    assert compare(bf16, [x + 0.1 for x in bf16], last=4, window=3)["mean_gap"] == pytest.approx(0.1)


def test_kernels_e2e_settings_are_kernels_names_or_named_overrides():
    from benchmarks.kernels_e2e import overrides

    assert overrides("auto") == ("auto", ["kernels=auto"])
    assert overrides('ce=kernels=compile "kernels.fused=[cross_entropy]"') == ("ce", ["kernels=compile", "kernels.fused=[cross_entropy]"])
    for bad in ("=kernels=eager", "ce=", "ce=  "):
        with pytest.raises(SystemExit, match="NAME=OVERRIDES"):
            overrides(bad)


def test_kernels_e2e_says_what_auto_chose_in_each_run():
    from benchmarks.kernels_e2e import auto_line

    record = {"fused": ["cross_entropy"], "compiled": [], "compile": False,
              "measured": {"block": {"picked": 7.069, "compile": 6.958, "eager": 7.261, "picked.host": 26.43, "compile.host": 27.63, "eager.host": 24.38}}}
    assert auto_line(record, "triton") == ("fused [cross_entropy], compiled [], compiled blocks no, optim.impl triton; "
                                           "block GPU (host) ms a step: picked 7.07 (26.43) / compile 6.96 (27.63) / eager 7.26 (24.38)")
    # no GPU to time on: the diagnosis alone decided, nothing was measured
    assert auto_line({"fused": ["rms_norm"], "compiled": [], "compile": False, "measured": {}}, "fused").endswith("optim.impl fused; nothing timed")


def test_fp8_loss_compares_every_variant_and_control_with_one_bf16_run(tmp_path, capsys):
    """One bf16 reference for all the float8 variants; a control (bf16, last bits changed) is
    reported beside them and never fails the bench; a variant past the tolerance does (exit 1)."""
    from benchmarks import fp8_loss

    base = [3.0 - 0.01 * i for i in range(30)]
    offsets = {"bf16": 0.0, "gw_hp": 0.06, "gw_tw": 0.08, "compiled": 0.07}
    seen = []

    def runner(name, overrides, args):
        seen.append((name, overrides))
        return [x + offsets[name] for x in base]

    argv = ["--steps", "30", "--last", "10", "--window", "5", "--tol", "0.05", "--out", str(tmp_path),
            "--variant", "gw_hp=precision=fp8 precision.fp8_recipe=rowwise_with_gw_hp", "--control", "compiled=kernels=compile"]
    results = fp8_loss.main(argv, runner=runner)
    assert seen == [("bf16", []), ("gw_hp", ["precision=fp8", "precision.fp8_recipe=rowwise_with_gw_hp"]), ("compiled", ["kernels=compile"])]
    # 0.06 is past --tol 0.05, but inside the control's rounding drift (0.07): within
    assert results["gw_hp"]["passed"] and results["gw_hp"]["max_abs_gap"] == pytest.approx(0.06)
    assert results["compiled"]["role"] == "control"
    saved = json.loads((tmp_path / "fp8_loss.json").read_text())
    assert saved["control_floor"] == pytest.approx(0.07) and saved["limit"] == pytest.approx(0.07)
    assert set(saved["losses"]) == {"bf16", "gw_hp", "compiled"} and saved["results"]["gw_hp"]["overrides"][0] == "precision=fp8"
    assert "rounding alone" in capsys.readouterr().out
    # without a control the tolerance is --tol itself: 0.06 fails; past the control's drift fails too
    with pytest.raises(SystemExit) as failed:
        fp8_loss.main([*argv[:10], "--variant", "gw_hp=precision=fp8"], runner=runner)
    assert failed.value.code == 1
    with pytest.raises(SystemExit) as failed:
        fp8_loss.main([*argv[:10], "--variant", "gw_tw=precision=fp8", "--control", "compiled=kernels=compile"], runner=runner)
    assert failed.value.code == 1
    assert [name for name, _ in seen[3:]] == ["bf16", "gw_hp", "bf16", "gw_tw", "compiled"]
    fp8_loss.main(argv[:10], runner=lambda name, overrides, args: seen.append((name, overrides)) or base)
    assert seen[-1] == ("fp8", ["precision=fp8"])  # no --variant: precision=fp8's default float8
    with pytest.raises(SystemExit) as clash:
        fp8_loss.main([*argv[:10], "--variant", "bf16=precision=fp8"], runner=runner)
    assert clash.value.code == 2
    with pytest.raises(SystemExit) as not_bf16:  # a float8 "control" would raise the limit to float8's own gap
        fp8_loss.main([*argv[:10], "--control", "c=precision=fp8 kernels=compile"], runner=runner)
    assert not_bf16.value.code == 2


def test_fp8_gemms_times_every_gemm_of_a_block_with_its_host_cost():
    """benchmarks/fp8_gemms.py on the CPU (torch._scaled_mm runs there too): every GEMM of a block's
    four linears in bf16 and the three float8 scalings, each with GPU-side ms and host us a call,
    and the block's sums; the float8 operands dequantize to the bf16 ones within e4m3's rounding."""
    import torch

    from benchmarks import fp8_gemms

    device = torch.device("cpu")
    rows = fp8_gemms.measure(32, 32, 64, device)
    assert [(r["linear"], r["gemm"]) for r in rows][:3] == [("qkv", "output"), ("qkv", "grad input"), ("qkv", "grad weight")]
    assert [(r["M"], r["K"], r["N"]) for r in rows if r["linear"] == "down"] == [(32, 64, 32), (32, 32, 64), (32, 32, 64)]
    for r in rows:
        for p in fp8_gemms.PROVIDERS:
            assert r[p]["ms"] > 0 and r[p]["host_us"] > 0 and r[p]["tflops"] > 0
    text = fp8_gemms.table(rows)
    assert "bf16 ms (TFLOP/s), host us" in text and "| fp8 rowwise, grad weight bf16 |" in text
    assert text.count("\n| ") == len(rows) + 4 + 1  # a row a GEMM, a line a block sum, the sums' header
    ops = fp8_gemms.operands(32, 64, 48, device)
    ref = ops["a"].float() @ ops["b"].float()
    for key in ("tensorwise", "rowwise"):
        a8, b8, sa, sb = ops[key]
        out = torch._scaled_mm(a8, b8, scale_a=sa, scale_b=sb, out_dtype=torch.float32)
        assert (out - ref).abs().max() <= 0.15 * ref.abs().max(), key  # e4m3 keeps 3 mantissa bits: ~6% an operand


def test_fp8_casts_run_each_linears_casts_as_the_linear_does(monkeypatch):
    """benchmarks/fp8_casts.py's passes in Triton's interpreter: X^T and dY^T read their rowwise cast's
    e4m3 bytes (1 byte an element) where fp8_linear.TRANSPOSE_FROM says so, the bf16 operand (2)
    otherwise; W^T always reads W; the down projection's X casts apply SiLU unless it is apart, and
    up's dY cast SiLU's gradient (reading U too); qkv's dY is cast from three pieces, and the biased
    linears' dY casts sum their columns, as Float8RowwiseLinearFunction's backward runs them."""
    pytest.importorskip("triton")
    import torch

    import perflab_kernels.triton.fp8_linear as fp8
    from benchmarks import fp8_casts

    passes = fp8_casts.linear_passes(32, 16, 64, "rowwise_with_gw_tensorwise")
    by_name = {(linear, name): casts for linear, name, casts in passes}
    assert [(c.operand, c.kind, c.act) for c in by_name["down", "forward"]] == [("X", "rowwise", "silu"), ("X", "transposed", "silu"), ("W", "rowwise", None)]
    assert all(c.act is None for c in by_name["up", "forward"])
    assert all(c.act is None for _, _, casts in fp8_casts.linear_passes(32, 16, 64, "rowwise_with_gw_tensorwise", act_in_cast=False) for c in casts)
    dy = {linear: by_name[linear, "backward"][0] for linear in ("qkv", "out", "up", "down")}
    assert [(d.act, d.pieces, d.col_sum) for d in dy.values()] == [(None, 3, True), (None, 1, True), ("silu_grad", 1, False), (None, 1, False)]
    assert dy["up"].nbytes == 32 * 64 * (2 + 2 + 1) + 4 * 32  # dY and U read, e4m3 written
    assert fp8_casts.linear_passes(32, 16, 64, "rowwise_with_gw_hp")[5][2][0].act is None  # gw_hp: dU in bf16, SiLU's gradient apart
    dyt, wt = by_name["qkv", "backward"][1:]
    assert (dyt.operand, dyt.kind, dyt.after_rowwise, wt.after_rowwise) == ("dY", "transposed", True, False)
    assert dyt.nbytes == 32 * 48 * 2 + 4 * (32 + 48) and wt.nbytes == 48 * 16 * 3 + 4 * 16
    monkeypatch.setattr(fp8, "TRANSPOSE_FROM", "input")
    assert dyt.nbytes == 32 * 48 * 3 + 4 * 48
    launched = []

    class Spy:
        """The launcher, noting each launch by name."""

        def __init__(self, name: str):
            self.name, self.real = name, getattr(fp8, name)

        def launch(self, *args):
            launched.append(self.name)
            return self.real.launch(*args)

    real = {kernel: getattr(fp8, kernel) for kernel in ("_launch_pieces", "_launch_rowwise")}
    for kernel in ("_launch_from_rowwise", "_launch_transposed", *real):
        monkeypatch.setattr(fp8, kernel, Spy(kernel))
    monkeypatch.setattr(fp8, "TRANSPOSE_FROM", "e4m3")
    run = fp8_casts.make_pass(by_name["qkv", "backward"] + by_name["up", "backward"], torch.device("cpu"))
    launched.clear()
    run()
    assert launched == ["_launch_pieces", "_launch_from_rowwise", "_launch_transposed", "_launch_rowwise", "_launch_from_rowwise", "_launch_transposed"]
    for kernel, launcher in real.items():
        monkeypatch.setattr(fp8, kernel, launcher)
    for source in ("input", "e4m3"):
        monkeypatch.setattr(fp8, "TRANSPOSE_FROM", source)
        launched.clear()
        fp8_casts.make_pass(by_name["down", "forward"] + by_name["down", "backward"], torch.device("cpu"))()
        assert launched == ({"input": ["_launch_transposed"] * 3, "e4m3": ["_launch_from_rowwise", "_launch_from_rowwise", "_launch_transposed"]}[source])


def test_kernels_e2e_table_shows_each_rounds_ratio_beside_the_median():
    from benchmarks.kernels_e2e import table

    def row(setting, rnd, tps):
        return {"setting": setting, "round": rnd, "tokens_per_s_per_device": tps, "mfu": None, "peak_mem_gb": 12.16,
                "step_time_s": 8192 / tps, "host_step_time_s": None, "final_loss": 11.0}

    # g8's two rounds at 8 x 128 tokens on an H200: eager swung 24,560 -> 15,144 tok/s, so the medians' 1.157x hides
    # a setting that lost in one round and won by half in the other
    rows = [row("eager", 0, 24560), row("both", 0, 23037), row("eager", 1, 15144), row("both", 1, 22895)]
    lines = table(rows, ["eager", "both"]).splitlines()
    assert lines[0].startswith("| kernels |") and "| vs eager | rounds |" in lines[0]
    eager, both = lines[2].split(" | "), lines[3].split(" | ")
    assert eager[7:9] == ["1.000x", "1.00-1.00x"]
    assert both[7:9] == ["1.157x", "0.94-1.51x"]
    assert table(rows[:2], ["eager", "both"]).splitlines()[3].split(" | ")[8] == "-"  # one round: no range to give


def test_fp8_loss_reports_the_steps_each_run_takes_to_bf16s_loss_at_a_step(tmp_path, capsys):
    """--target-step: bf16's curve at that step is the target; a run whose curve sits 0.05 above
    bf16's reaches it 5 steps later (the curves fall 0.01 a step), one that never gets there: None."""
    from benchmarks import fp8_loss

    base = [3.0 - 0.01 * i for i in range(40)]
    offsets = {"bf16": 0.0, "late": 0.05, "never": 1.0}
    argv = ["--steps", "40", "--last", "10", "--window", "5", "--tol", "2", "--out", str(tmp_path), "--target-step", "30",
            "--variant", "late=precision=fp8", "--variant", "never=precision=fp8 precision.fp8_recipe=rowwise_with_gw_hp"]
    results = fp8_loss.main(argv, runner=lambda name, overrides, args: [x + offsets[name] for x in base])
    assert results["late"]["steps_to_target"] == 35 and results["never"]["steps_to_target"] is None
    assert "late" in capsys.readouterr().out and json.loads((tmp_path / "fp8_loss.json").read_text())["target_step"] == 30
    with pytest.raises(SystemExit):
        fp8_loss.main([*argv[:10], "--target-step", "41"], runner=lambda name, overrides, args: base)
