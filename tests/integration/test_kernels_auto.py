"""kernels=auto: the fused variants follow a diagnosis; the choice is logged; no diagnosis, one line."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from omegaconf import OmegaConf

from src.config.compose import ConfigError, compose_config
from src.fusion.choice import auto_choice, choose
from tests.support.cli import run_cli

FIXTURE = Path(__file__).parents[1] / "fixtures" / "mini_llm_h200_diagnosis.json"
TINY = ["model=tiny", "train.steps=3", "data.batch_size=2", "data.seq_len=16", "dist.nproc=1", "precision=fp32"]


def _with_verdicts(tmp_path: Path, verdicts: dict[str, tuple[str, str]]) -> Path:
    """The fixture with every op compute-bound except the keys given (key -> (bound, limiter))."""
    d = json.loads(FIXTURE.read_text())
    for op in d["ops"]:
        op["bound"], op["limiter"] = verdicts.get(op["key"], ("compute-bound", "sm"))
    path = tmp_path / "diagnosis.json"
    path.write_text(json.dumps(d))
    return path


def test_auto_picks_exactly_the_memory_bound_and_latency_limited_ops_of_the_fixture():
    # mini_llm's step on one H200: SiLU and the backward softmax memory-bound, the norms, residual
    # adds and the loss's softmax latency-limited; GEMMs (compute-bound), flash attention and the
    # loss kernels (occupancy-limited) are left alone, as are fills and casts (no fused variant);
    # AdamW's multi_tensor_apply kernels, latency-limited, call for the optimizer's own candidate.
    choice = choose(FIXTURE)
    assert set(choice.ops) == {"swiglu", "softmax", "rms_norm", "cross_entropy", "adamw"}
    assert choice.device == "NVIDIA H200"
    assert "layers.*.ffn/silu: memory-bound" in " ".join(choice.ops["swiglu"])
    assert any(line.startswith("loss/softmax: neither (latency)") for line in choice.ops["cross_entropy"])


def test_auto_follows_the_verdicts_not_the_op_names(tmp_path):
    only_silu = _with_verdicts(tmp_path, {"layers.*.ffn/silu": ("memory-bound", "hbm")})
    assert set(choose(only_silu).ops) == {"swiglu"}
    occupancy = _with_verdicts(tmp_path, {"layers.*.norm1/rms_norm": ("neither", "occupancy")})
    assert choose(occupancy).ops == {}
    both = _with_verdicts(tmp_path, {"add": ("memory-bound", "hbm"), "loss/softmax": ("neither", "latency")})
    assert set(choose(both).ops) == {"rms_norm", "cross_entropy"}


def test_without_a_diagnosis_auto_names_the_command_that_makes_one(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ConfigError, match=r"none is under ./outputs or ./multirun; make one on an NVIDIA GPU with Nsight Compute: `python -m src.run \+exp=diagnose model=tiny backend=cuda`"):
        auto_choice(compose_config(["kernels=auto", "model=tiny"]), tmp_path)
    proc = run_cli(["kernels=auto", *TINY], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith("error: kernels=auto reads a diagnosis of model=tiny")
    assert not (tmp_path / "outputs").exists()
    proc = run_cli(["kernels=auto", "kernels.diagnosis=nowhere.json", *TINY], cwd=tmp_path)
    assert proc.returncode == 2 and "kernels.diagnosis=nowhere.json: no diagnosis.json there" in proc.stderr


def test_on_a_gpu_without_a_diagnosis_auto_times_every_fusable_op_and_says_so(tmp_path, monkeypatch, caplog):
    """A fresh GPU machine: no diagnosis anywhere, so every op with a fused variant (and AdamW's
    kernels) is a candidate, the timing alone decides, and the log says that is what happened. A
    named diagnosis that is missing is still refused: the user asked for that one."""
    import logging

    import src.fusion.choice as choice_mod
    import src.fusion.measure as measure_mod
    from src.fusion.choice import MEASURED_ONLY, apply_auto_choice

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(choice_mod, "_gpu_present", lambda: True)
    timer, calls = _stub_timer({("rms_norm", "eager"): 0.10, ("rms_norm", "triton"): 0.05, ("add_rms_norm", "eager"): 0.15,
                                ("add_rms_norm", "triton"): 0.08, ("swiglu", "eager"): 0.3, ("swiglu", "triton"): 0.2,
                                ("head_loss", "eager"): 1.0, ("head_loss", "triton"): 0.9, ("head_loss", "linear_cross_entropy"): 0.6,
                                ("block", "picked"): 0.5, ("block", "compile"): 0.6, ("block", "eager"): 0.7})
    monkeypatch.setattr(measure_mod, "measure_on_gpu", lambda ops, cfg: measure_mod.measure(ops, cfg, timer))
    cfg = compose_config(["kernels=auto", "model=llama3_tiny", "backend=cuda", "dist.nproc=1", "data.seq_len=64"])
    caplog.set_level(logging.INFO, logger="src.run")
    choice = apply_auto_choice(cfg, tmp_path, run_dir=tmp_path)
    assert choice.diagnosis == "" and set(choice.ops) >= {"rms_norm", "swiglu", "cross_entropy"}
    assert all(lines == [MEASURED_ONLY] for lines in choice.ops.values())
    assert {case for case, *_ in calls} >= {"rms_norm", "swiglu", "head_loss", "block"}  # what LLaMA has, timed
    assert set(cfg.kernels.fused) == {"rms_norm", "swiglu", "linear_cross_entropy"}
    assert any("no diagnosis of model=llama3_tiny" in r.getMessage() and "timing alone decides" in r.getMessage() for r in caplog.records)
    # the run then records that choice (kernels_auto.json, the log) with no diagnosis file to read: the
    # timings from the file the launching process wrote
    from src.fusion.registry import FusedModel
    from src.tracking.mlflow_run import NullTracker
    from src.train.records import log_auto_choice

    caplog.set_level(logging.INFO, logger="src.train")
    log_auto_choice(cfg, FusedModel(swapped={"rms_norm": 2, "swiglu": 1}), tmp_path, NullTracker())
    record = json.loads((tmp_path / "kernels_auto.json").read_text())
    assert record["diagnosis"] == "" and set(record["fused"]) == set(cfg.kernels.fused) and set(record["ops"]) == set(choice.measured)
    assert record["measured"] == choice.measured and record["swapped"] == {"rms_norm": 2, "swiglu": 1}
    assert any("from timing on this GPU" in r.getMessage() for r in caplog.records)
    with pytest.raises(ConfigError, match="kernels.diagnosis=nowhere.json: no diagnosis.json there"):
        apply_auto_choice(compose_config(["kernels=auto", "kernels.diagnosis=nowhere.json", "backend=cuda", "dist.nproc=1"]), tmp_path)


@pytest.mark.parametrize("fused_head_ms, trial", [(0.93, True), (1.2, False)], ids=["within-the-band", "further-off"])
def test_a_fused_head_that_times_like_the_loss_alone_is_decided_by_the_run_s_own_steps(tmp_path, monkeypatch, caplog, fused_head_ms, trial):
    """The fused head + loss within HEAD_BAND of the fastest loss timed alone (here 3% slower than the
    fused cross-entropy): auto keeps both, the loss trial's pairs are set, and the run's steps decide
    (src/fusion/trial.py); 20% slower, the loss alone is the choice and nothing is tried. float8's head
    is fused whatever the timing, and never tried."""
    import logging

    import src.fusion.choice as choice_mod
    import src.fusion.measure as measure_mod
    from src.fusion.choice import apply_auto_choice
    from src.fusion.measure import HEAD_TRIAL_PAIRS

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(choice_mod, "_gpu_present", lambda: True)
    timer, _ = _stub_timer({("rms_norm", "eager"): 0.10, ("add_rms_norm", "eager"): 0.15, ("swiglu", "eager"): 0.3,
                            ("head_loss", "eager"): 1.5, ("head_loss", "triton"): 0.9, ("head_loss", "linear_cross_entropy"): fused_head_ms,
                            ("block", "picked"): 0.5, ("block", "compile"): 0.4})
    monkeypatch.setattr(measure_mod, "measure_on_gpu", lambda ops, cfg: measure_mod.measure(ops, cfg, timer))
    cfg = compose_config(["kernels=auto", "model=llama3_tiny", "backend=cuda", "dist.nproc=1", "data.seq_len=64", "train.steps=20"])
    caplog.set_level(logging.INFO, logger="src.run")
    choice = apply_auto_choice(cfg, tmp_path, run_dir=tmp_path)
    assert cfg.kernels.compile  # the block compiled: its ops' own picks drop out
    if trial:
        assert list(cfg.kernels.fused) == ["cross_entropy", "linear_cross_entropy"] and cfg.kernels.loss_trial == HEAD_TRIAL_PAIRS
        assert choice.head_trial == "triton"
        assert any("the run's own steps decide between them" in r.getMessage() for r in caplog.records)
    else:
        assert list(cfg.kernels.fused) == ["cross_entropy"] and cfg.kernels.loss_trial == 0 and choice.head_trial == ""
    # a run too short for the trial's steps keeps the timed pick alone
    short = compose_config(["kernels=auto", "model=llama3_tiny", "backend=cuda", "dist.nproc=1", "data.seq_len=64", "train.steps=4"])
    apply_auto_choice(short, tmp_path)
    assert list(short.kernels.fused) == ["cross_entropy"] and short.kernels.loss_trial == 0


def test_the_fused_head_beside_a_fused_loss_keeps_that_loss_for_the_trial_s_logits_steps():
    import torch

    from src.fusion.registry import REGISTRY, apply_fused, load
    from src.models import build_model

    model = build_model(compose_config(["model=llama3_tiny", "model.tie_embeddings=false"]).model)
    both = apply_fused(model, ["cross_entropy", "linear_cross_entropy"])
    assert both.loss_in_model and both.loss_fn is None and both.loss_beside_head is load(REGISTRY["cross_entropy"].triton.loss)
    assert model(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)  # the fused head still gives logits
    alone = apply_fused(build_model(compose_config(["model=llama3_tiny", "model.tie_embeddings=false"]).model), ["linear_cross_entropy"])
    assert alone.loss_in_model and alone.loss_beside_head is None


def test_auto_finds_this_models_diagnosis_swaps_its_ops_and_logs_why(tmp_path, mlflow_store):
    # A diagnose run of model=tiny as task=diagnose leaves it: RUN/config.yaml, RUN/diagnose/diagnosis.json.
    run = tmp_path / "outputs" / "2026-11-30" / "00-00-00"
    (run / "diagnose").mkdir(parents=True)
    shutil.copy(_with_verdicts(tmp_path, {"layers.*.norm2/rms_norm": ("neither", "latency"), "silu": ("memory-bound", "hbm")}), run / "diagnose" / "diagnosis.json")
    (run / "config.yaml").write_text(OmegaConf.to_yaml(compose_config(["model=tiny", "task=diagnose"])))
    other = tmp_path / "multirun" / "x" / "0"  # a newer diagnosis of another model is not taken
    (other / "diagnose").mkdir(parents=True)
    shutil.copy(FIXTURE, other / "diagnose" / "diagnosis.json")
    (other / "config.yaml").write_text(OmegaConf.to_yaml(compose_config(["model=mini_llm"])))

    mlflow_store(tmp_path)
    proc = run_cli(["kernels=auto", *TINY], cwd=tmp_path)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out
    assert "fused Triton kernels: rms_norm x4, swiglu x0" in out
    assert "swiglu  (this model has none to swap) <- silu: memory-bound" in out

    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json")]
    record = json.loads((run_dir / "kernels_auto.json").read_text())
    assert record["diagnosis"] == str(run / "diagnose" / "diagnosis.json")
    assert record["swapped"] == {"rms_norm": 4, "swiglu": 0}
    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (mlrun,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert mlrun.data.params["kernels.fused"] == "['rms_norm', 'swiglu']"
    assert mlrun.data.tags["kernels.auto"] == "rms_norm, swiglu"
    assert mlrun.data.tags["kernels.auto.decided_by"] == "diagnosis"  # no GPU here to time the candidates on
    assert "no GPU here to time the candidates on; the diagnosis alone decides" in out
    assert record["measured"] == {} and record["compiled"] == []
    assert "kernels_auto.json" in [a.path for a in client.list_artifacts(mlrun.info.run_id)]


# --- kernels=auto by measurement (src/fusion/measure.py): the decision, given timings -----------

def _seed_cfg(**overrides):
    cfg = compose_config(["+exp=fsdp4", "dist.nproc=1", *[f"{k}={v}" for k, v in overrides.items()]])
    return cfg


def _stub_timer(table: dict[tuple[str, str], float]):
    """(bench case, candidate) -> ms for one forward + backward; a missing pair raises, as a
    candidate that fails to compile does."""
    calls = []

    def timer(use, candidate):
        calls.append((use.case, tuple(use.shape), use.per_step, candidate))
        if (use.case, candidate) not in table:
            raise RuntimeError(f"{candidate} does not compile here")
        return table[(use.case, candidate)]

    return timer, calls


def test_auto_measures_each_use_per_step_and_picks_the_fastest():
    from src.fusion.measure import chosen, measure

    cfg = _seed_cfg()  # mini_llm: 12 blocks, 8 x 1024 tokens a GPU, dim 2048, vocab 32000
    timer, calls = _stub_timer({
        ("rms_norm", "eager"): 0.10, ("rms_norm", "compile"): 0.07, ("rms_norm", "triton"): 0.08,
        ("add_rms_norm", "eager"): 0.15, ("add_rms_norm", "compile"): 0.09, ("add_rms_norm", "triton"): 0.10,
        ("head_loss", "eager"): 7.4, ("head_loss", "compile"): 5.3, ("head_loss", "triton"): 6.6, ("head_loss", "linear_cross_entropy"): 5.1,
        ("block", "picked"): 5.0, ("block", "compile"): 4.9,  # compile within the noise of the picks
    })
    timings = {t.op: t for t in measure(["swiglu", "softmax", "rms_norm", "cross_entropy"], cfg, timer)}
    # swiglu and softmax: the seed's model has no module of either, so nothing is timed for them
    assert set(timings) == {"rms_norm", "cross_entropy", "block"}
    assert ("rms_norm", (8192, 2048), 13, "eager") in calls and ("add_rms_norm", (8192, 2048), 12, "eager") in calls
    assert timings["rms_norm"].ms["eager"] == pytest.approx(13 * 0.10 + 12 * 0.15)
    assert timings["rms_norm"].pick == "compile"
    # the loss is timed with the head it follows; the fused linear + CE replaces both
    assert ("head_loss", (8192, 2048, 32000), 1, "linear_cross_entropy") in calls
    assert timings["cross_entropy"].pick == "linear_cross_entropy"
    # the block is timed once per block of the step, as the in-block picks run it and compiled
    assert ("block", (8, 1024, 2048), 12, "picked") in calls and ("block", (8, 1024, 2048), 12, "compile") in calls
    assert ("block", (8, 1024, 2048), 12, "eager") in calls  # a pick changed the block: eager is weighed too (it failed here)
    assert timings["block"].ms == {"picked": pytest.approx(12 * 5.0), "compile": pytest.approx(12 * 4.9), "eager": None}
    assert timings["block"].pick == "picked"
    assert chosen(list(timings.values())) == (["linear_cross_entropy"], ["rms_norm"], False)


def test_the_search_says_where_its_time_went_op_by_op():
    """Each op's candidates are clocked where they are timed (built, compiled, timed), and the log's
    line splits the search's wall time into them and the timing process's own start."""
    import time

    from src.fusion.choice import search_seconds
    from src.fusion.measure import measure

    table = {("rms_norm", c): 0.1 for c in ("eager", "compile", "triton")} | {("add_rms_norm", c): 0.1 for c in ("eager", "compile", "triton")}
    table |= {("block", "picked"): 5.0, ("block", "compile"): 4.0}
    timer, _ = _stub_timer(table)

    def slow_block(use, candidate):
        if use.case == "block":
            time.sleep(0.2)  # a compile
        return timer(use, candidate)

    timings = {t.op: t for t in measure(["rms_norm"], _seed_cfg(), slow_block)}
    assert timings["block"].seconds >= 0.4 and timings["rms_norm"].seconds < timings["block"].seconds
    line = search_seconds([timings["rms_norm"], timings["block"]], 5.0)
    assert line == f"5 s (rms_norm {timings['rms_norm'].seconds:.0f}, block {timings['block'].seconds:.0f}, the process {5.0 - timings['rms_norm'].seconds - timings['block'].seconds:.0f})"


def test_a_compiled_block_that_beats_the_picks_subsumes_the_in_block_ops():
    from src.fusion.measure import chosen, measure

    cfg = _seed_cfg()
    picks_seen = []
    timer, calls = _stub_timer({
        ("rms_norm", "eager"): 0.10, ("rms_norm", "compile"): 0.11, ("rms_norm", "triton"): 0.06,
        ("add_rms_norm", "eager"): 0.15, ("add_rms_norm", "compile"): 0.15, ("add_rms_norm", "triton"): 0.08,
        ("head_loss", "eager"): 7.4, ("head_loss", "compile"): 7.3, ("head_loss", "triton"): 6.6, ("head_loss", "linear_cross_entropy"): 6.9,
        ("block", "picked"): 5.0, ("block", "compile"): 4.6,
    })

    def recording(use, candidate):
        if use.case == "block":
            picks_seen.append(dict(use.picks))
        return timer(use, candidate)

    timings = {t.op: t for t in measure(["rms_norm", "cross_entropy"], cfg, recording)}
    assert picks_seen and all(p == {"rms_norm": "triton"} for p in picks_seen)  # the block as the per-op picks run it
    assert timings["rms_norm"].pick == "triton" and timings["block"].pick == "compile"
    # compiled blocks: the Triton norm is dropped, the loss (outside the blocks) keeps its pick
    assert chosen(list(timings.values())) == (["cross_entropy"], [], True)
    # a block candidate that fails to run is never chosen
    timer2, _ = _stub_timer({("rms_norm", "eager"): 0.10, ("add_rms_norm", "eager"): 0.15, ("block", "picked"): 5.0})
    (norm, block) = measure(["rms_norm"], cfg, timer2)
    assert block.ms == {"picked": pytest.approx(60.0), "compile": None} and block.pick == "picked"  # picks all eager: no eager twin
    assert chosen([norm, block]) == ([], [], False)


def test_a_candidate_must_beat_eager_by_more_than_the_noise_and_a_failing_one_is_never_chosen():
    from src.fusion.measure import NOISE, measure, pick

    assert pick({"eager": 1.0, "compile": 1.0 - NOISE / 2, "triton": 1.01}) == "eager"
    assert pick({"eager": 1.0, "compile": None, "triton": 0.9}) == "triton"
    assert pick({"eager": None, "compile": None, "triton": None}) == "eager"
    cfg = _seed_cfg(**{"model.mlp": "swiglu"})
    timer, _ = _stub_timer({("swiglu", "eager"): 0.6, ("swiglu", "triton"): 0.34})  # compile fails to run
    t, block = measure(["swiglu"], cfg, timer)
    assert block.op == "block" and block.pick == "picked"  # neither block candidate ran: the picks stand
    assert t.ms == {"eager": pytest.approx(12 * 0.6), "compile": None, "triton": pytest.approx(12 * 0.34)}
    assert t.pick == "triton"


def test_compiled_ops_keep_the_parameters_and_give_the_eager_loss(monkeypatch):
    """kernels.compiled swaps modules in place as the fused swaps do; Inductor itself is torch's to
    test (its CPU compile takes minutes on 2 cores), so the compiled callables are the plain ones here."""
    import torch

    import src.fusion.compiled as co
    from src.models.mini_llm.model import MiniLLM

    monkeypatch.setattr(co, "_compiled_rms_norm", co._rms_norm)
    monkeypatch.setattr(co, "_compiled_add_rms_norm", co._add_rms_norm)
    monkeypatch.setattr(co, "_compiled_cross_entropy", torch.nn.functional.cross_entropy)
    torch.manual_seed(0)
    eager, swapped = MiniLLM(vocab_size=64, dim=32, n_layers=2, n_heads=2), MiniLLM(vocab_size=64, dim=32, n_layers=2, n_heads=2)
    swapped.load_state_dict(eager.state_dict())
    params = {n: p for n, p in swapped.named_parameters()}
    counts, loss_fn = co.apply_compiled(swapped, ["rms_norm", "cross_entropy"])
    assert counts == {"rms_norm": 4} and loss_fn is co.compiled_cross_entropy
    assert {n: p for n, p in swapped.named_parameters()} == params  # the same Parameter objects, same names
    x, y = torch.randint(0, 64, (2, 8)), torch.randint(0, 64, (2, 8))
    want = torch.nn.functional.cross_entropy(eager(x).reshape(-1, 64), y.reshape(-1))
    got = loss_fn(swapped(x).reshape(-1, 64), y.reshape(-1))
    torch.testing.assert_close(got, want)
    with pytest.raises(ValueError, match=r"kernels.compiled=\['softmax'\]: no compiled variant"):
        co.apply_compiled(swapped, ["softmax"])


def test_an_op_without_a_compiled_variant_is_refused_in_one_line(tmp_path):
    proc = run_cli(["kernels.compiled=[softmax]", *TINY], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines() == [
        "error: kernels.compiled=['softmax']: no compiled variant of that op; there are: rms_norm, swiglu, cross_entropy"]


def test_auto_picks_by_gpu_time_and_records_each_candidates_host_time_beside_it():
    """A timer that gives (GPU ms, host ms): the pick follows GPU time alone (the step runs with the
    host ahead), the host time is summed per step beside it, and a timer giving GPU time alone
    leaves the host time unknown (None), not zero."""
    from src.fusion.measure import measure

    cfg = _seed_cfg()
    table = {("rms_norm", "eager"): (0.10, 0.15), ("rms_norm", "compile"): (0.07, 0.60), ("rms_norm", "triton"): (0.054, 0.35),
             ("add_rms_norm", "eager"): (0.15, 0.20), ("add_rms_norm", "compile"): (0.09, 0.65), ("add_rms_norm", "triton"): (0.079, 0.45),
             ("block", "picked"): (4.6, 2.0), ("block", "compile"): (4.55, 1.2)}
    timer, _ = _stub_timer(table)
    norm, block = measure(["rms_norm"], cfg, timer)
    assert norm.pick == "triton"  # the slowest host path of the three, the least GPU time
    assert norm.ms["triton"] == pytest.approx(13 * 0.054 + 12 * 0.079)
    assert norm.host_ms == {"eager": pytest.approx(13 * 0.15 + 12 * 0.20), "compile": pytest.approx(13 * 0.60 + 12 * 0.65),
                            "triton": pytest.approx(13 * 0.35 + 12 * 0.45)}
    assert block.pick == "picked" and block.host_ms["compile"] == pytest.approx(12 * 1.2)
    gpu_only, _ = _stub_timer({k: v[0] for k, v in table.items()})
    norm, _ = measure(["rms_norm"], cfg, gpu_only)
    assert norm.pick == "triton" and norm.host_ms == {"eager": None, "compile": None, "triton": None}


def test_a_block_is_charged_the_larger_of_its_gpu_and_host_time():
    """The blocks are most of the step: a block whose host path outlasts its kernels makes the step
    wait on the host, so compile wins there even at equal GPU time; where both queue faster than
    they run, GPU time decides alone."""
    from src.fusion.measure import HOST_CHARGED, block_paid_ms, chosen, measure

    cfg = _seed_cfg()
    norms = {("rms_norm", "eager"): (0.10, 0.15), ("add_rms_norm", "eager"): (0.15, 0.20)}
    host_bound, _ = _stub_timer({**norms, ("block", "picked"): (4.30, 5.40), ("block", "compile"): (4.25, 1.60)})
    _, block = measure(["rms_norm"], cfg, host_bound)
    assert block_paid_ms(block) == {"picked": pytest.approx(12 * 5.40), "compile": pytest.approx(12 * 4.25)}
    assert block.pick == "compile" and chosen([block])[2] is True and block.why == HOST_CHARGED  # GPU time alone: 1% apart, picked
    gpu_bound, _ = _stub_timer({**norms, ("block", "picked"): (4.30, 3.90), ("block", "compile"): (4.25, 1.60)})
    _, block = measure(["rms_norm"], cfg, gpu_bound)
    assert block_paid_ms(block)["picked"] == pytest.approx(12 * 4.30) and block.pick == "picked" and block.why == ""  # inside the noise
    # a host time not taken (a GPU-only timer) leaves GPU time alone to decide; a failed candidate stays None
    gpu_only, _ = _stub_timer({("rms_norm", "eager"): 0.1, ("add_rms_norm", "eager"): 0.15, ("block", "picked"): 4.3})
    _, block = measure(["rms_norm"], cfg, gpu_only)
    assert block_paid_ms(block) == {"picked": pytest.approx(12 * 4.3), "compile": None} and block.pick == "picked"


def test_a_host_bound_block_drops_picks_that_won_on_gpu_time_alone():
    """At 1024 tokens a step the fused norms save GPU time and cost host time, and the blocks are
    host-bound: eager, weighed as a block beside the picks and compile, is kept where it is paid
    least, and the in-block picks are dropped (the loss, outside the blocks, keeps its own)."""
    from src.fusion.measure import HOST_CHARGED, block_paid_ms, chosen, measure

    cfg = _seed_cfg(**{"data.seq_len": 128})
    table = {("rms_norm", "eager"): (0.020, 0.20), ("rms_norm", "triton"): (0.013, 0.48),
             ("add_rms_norm", "eager"): (0.022, 0.22), ("add_rms_norm", "triton"): (0.014, 0.52),
             ("head_loss", "eager"): (1.00, 0.64), ("head_loss", "triton"): (0.60, 0.85),
             ("block", "picked"): (0.60, 2.67), ("block", "compile"): (0.59, 2.16), ("block", "eager"): (0.62, 2.05)}
    timer, calls = _stub_timer(table)
    timings = measure(["rms_norm", "cross_entropy"], cfg, timer)
    norm, loss, block = timings
    assert norm.pick == "triton" and loss.pick == "triton" and ("block", (8, 128, 2048), 12, "eager") in calls
    assert block_paid_ms(block) == {"picked": pytest.approx(12 * 2.67), "compile": pytest.approx(12 * 2.16), "eager": pytest.approx(12 * 2.05)}
    assert block.pick == "eager" and block.why == HOST_CHARGED
    assert chosen(timings) == (["cross_entropy"], [], False)
    # where the blocks are GPU-bound the picks' GPU time stands, eager's host path notwithstanding
    gpu_bound, _ = _stub_timer({**table, ("block", "picked"): (4.30, 2.60), ("block", "compile"): (4.40, 2.1), ("block", "eager"): (4.45, 2.0)})
    timings = measure(["rms_norm", "cross_entropy"], cfg, gpu_bound)
    assert timings[-1].pick == "picked" and chosen(timings) == (["rms_norm", "cross_entropy"], [], False)


def test_a_host_bound_block_points_to_cuda_graphs_and_auto_weighs_graphs_where_they_are_on(tmp_path, monkeypatch, caplog):
    """Where the chosen block queues slower than it runs, the log names speed.cudagraphs (and, under FSDP2,
    speed.keep_unsharded); with graphs on, the compiled candidate is timed replayed (a launch's host) and wins
    where it does; where auto then compiles nothing, the log says nothing replays."""
    import logging

    import src.fusion.choice as choice_mod
    import src.fusion.measure as measure_mod
    from src.fusion.choice import apply_auto_choice
    from src.fusion.measure import graphs_hint, measure

    launched = {("rms_norm", "eager"): (0.020, 0.20), ("rms_norm", "triton"): (0.013, 0.48),
                ("add_rms_norm", "eager"): (0.022, 0.22), ("add_rms_norm", "triton"): (0.014, 0.52),
                ("head_loss", "eager"): (1.00, 0.64), ("head_loss", "triton"): (0.60, 0.85),
                ("block", "picked"): (0.60, 2.67), ("block", "compile"): (0.59, 2.16), ("block", "eager"): (0.62, 2.05)}
    replayed = {**launched, ("block", "compile"): (0.58, 0.09)}  # one graph launch a block instead of Inductor's ~50
    table = {"timer": launched}
    monkeypatch.setattr(choice_mod, "_gpu_present", lambda: True)
    monkeypatch.setattr(measure_mod, "measure_on_gpu", lambda ops, cfg: measure(ops, cfg, _stub_timer(table["timer"])[0]))
    auto = {"backend": "cuda", "kernels": "auto", "kernels.diagnosis": str(FIXTURE), "data.seq_len": 128}

    caplog.set_level(logging.INFO, logger="src.run")
    cfg = _seed_cfg(**auto)
    apply_auto_choice(cfg, tmp_path)
    assert cfg.kernels.compile is False and list(cfg.kernels.fused) == ["cross_entropy"]  # eager blocks, as host time decides
    hint = [r.getMessage() for r in caplog.records if "queue slower than they run" in r.getMessage()]
    assert hint == ["kernels=auto: the blocks as chosen (eager) queue slower than they run, 24.6 ms of host a step against 7.4 of GPU; "
                    "speed.cudagraphs=true with speed.keep_unsharded=true (FSDP2 then keeps the gathered weights where the graphs "
                    "read them; the whole param_dtype model stays on each GPU) lets auto weigh compiled blocks replayed from CUDA graphs, "
                    "one launch a graph"]

    caplog.clear()
    graphs = _seed_cfg(**auto, **{"speed.cudagraphs": "true", "speed.keep_unsharded": "true"})
    apply_auto_choice(graphs, tmp_path)  # still the launched timings: eager blocks again, so nothing is compiled to replay
    said = [r.getMessage() for r in caplog.records]
    assert "auto compiled nothing; the step launches its kernels one by one" in said[-1]
    assert not any("queue slower than they run" in m for m in said) and "replayed from CUDA graphs" in said[0]

    table["timer"] = replayed
    apply_auto_choice(graphs, tmp_path)
    assert graphs.kernels.compile is True and graphs.speed.cudagraphs is True and list(graphs.kernels.fused) == ["cross_entropy"]
    # a GPU-bound block gives no hint: the seed's shapes, where the blocks run longer than they queue
    gpu_bound = measure(["rms_norm"], _seed_cfg(), _stub_timer({**launched, ("block", "picked"): (4.30, 2.60), ("block", "compile"): (4.40, 2.1),
                                                                ("block", "eager"): (4.45, 2.0)})[0])[-1]
    assert gpu_bound.pick == "picked" and graphs_hint(gpu_bound, _seed_cfg()) is None


def test_float8_blocks_are_compiled_whenever_they_compile():
    """With precision=fp8 the block timings are taken and recorded, and compiled blocks are used
    even where the eager block timed faster alone (its casts' Python launches cost the step more
    than a block alone shows); a compile that fails leaves the eager blocks."""
    from src.fusion.measure import FLOAT8_EAGER_BLOCKS, block_paid_ms, chosen, measure

    cfg = _seed_cfg(precision="fp8", **{"precision.fp8_impl": "triton", "precision.fp8_recipe": "rowwise_with_gw_hp"})
    norms = {("rms_norm", "eager"): (0.10, 0.15), ("add_rms_norm", "eager"): (0.15, 0.20)}
    timer, _ = _stub_timer({**norms, ("block", "picked"): (4.20, 3.10), ("block", "compile"): (4.35, 3.60)})
    _, block = measure(["rms_norm"], cfg, timer)
    assert block_paid_ms(block) == {"picked": pytest.approx(12 * 4.20), "compile": pytest.approx(12 * 4.35)}
    assert block.pick == "compile" and block.why == FLOAT8_EAGER_BLOCKS and chosen([block])[2] is True
    broken, _ = _stub_timer({**norms, ("block", "picked"): (4.20, 3.10)})
    _, block = measure(["rms_norm"], cfg, broken)
    assert block.pick == "picked" and block.why == "" and chosen([block])[2] is False
    # where compile wins on GPU time there is nothing to explain
    faster, _ = _stub_timer({**norms, ("block", "picked"): (4.30, 5.40), ("block", "compile"): (3.90, 1.60)})
    _, block = measure(["rms_norm"], cfg, faster)
    assert block.pick == "compile" and block.why == ""
    # a diagnosis that names no in-block op still has the float8 block weighed (and compiled), as picked: eager
    loss_only, calls = _stub_timer({("head_loss", c): (5.0, 0.5) for c in ("eager", "compile", "triton", "linear_cross_entropy")}
                                   | {("block", "picked"): (4.20, 3.10), ("block", "compile"): (4.35, 3.60)})
    _, block = measure(["cross_entropy"], cfg, loss_only)
    assert ("block", (8, 1024, 2048), 12, "picked") in calls and block.pick == "compile" and chosen([block])[2] is True
    assert measure(["cross_entropy"], _seed_cfg(), loss_only)[-1].op == "cross_entropy"  # bf16: no in-block op, no block


def test_auto_writes_each_measured_choice_into_the_config_and_its_timings_and_reasons_beside_it(tmp_path, monkeypatch):
    """apply_auto_choice on a GPU (here: the timings from a stub timer in place of the spawned GPU
    child): the picks become kernels.fused / compile / optim.impl; the timings (measured), and why a
    pick is not the fastest timing's (reasons: the float8 block), are the choice's and kernels_auto.json's,
    not settings."""
    import src.fusion.choice as choice_mod
    import src.fusion.measure as measure_mod
    from src.fusion.choice import apply_auto_choice
    from src.fusion.measure import FLOAT8_EAGER_BLOCKS, measure

    timer, _ = _stub_timer({
        ("rms_norm", "eager"): (0.10, 0.15), ("rms_norm", "compile"): (0.11, 0.6), ("rms_norm", "triton"): (0.06, 0.35),
        ("add_rms_norm", "eager"): (0.15, 0.20), ("add_rms_norm", "compile"): (0.15, 0.65), ("add_rms_norm", "triton"): (0.08, 0.45),
        ("head_loss", "eager"): (5.4, 0.3), ("head_loss", "compile"): (4.9, 0.9), ("head_loss", "triton"): (4.7, 0.8),
        ("head_loss", "linear_cross_entropy"): (4.9, 2.2), ("adamw", "eager"): (6.8, 2.0), ("adamw", "triton"): (5.3, 2.8),
        ("block", "picked"): (3.55, 3.1), ("block", "compile"): (3.6, 3.2),  # the eager float8 block timed faster alone
    })
    monkeypatch.setattr(choice_mod, "_gpu_present", lambda: True)
    monkeypatch.setattr(measure_mod, "measure_on_gpu", lambda ops, cfg: measure(ops, cfg, timer))
    cfg = _seed_cfg(precision="fp8", backend="cuda", **{"kernels": "auto", "kernels.diagnosis": str(FIXTURE), "precision.fp8_impl": "triton",
                                                        "precision.fp8_recipe": "rowwise_with_gw_hp"})
    choice = apply_auto_choice(cfg, tmp_path, run_dir=tmp_path)
    k = cfg.kernels
    assert list(k.fused) == ["cross_entropy"] and k.compile is True and str(cfg.optim.impl) == "triton"  # compiled blocks drop the Triton norms
    assert "measured" not in k and "reasons" not in k
    assert choice.reasons == {"block": FLOAT8_EAGER_BLOCKS}
    assert choice.measured["block"]["picked"] == pytest.approx(12 * 3.55) and choice.measured["block"]["compile.host"] == pytest.approx(12 * 3.2)
    record = json.loads((tmp_path / "kernels_auto.json").read_text())
    assert record["measured"] == choice.measured and record["reasons"] == choice.reasons and record["fused"] == ["cross_entropy"]
    bf16 = _seed_cfg(backend="cuda", **{"kernels": "auto", "kernels.diagnosis": str(FIXTURE)})
    plain = apply_auto_choice(bf16, tmp_path)
    assert bf16.kernels.compile is False and plain.reasons == {} and list(bf16.kernels.fused) == ["rms_norm", "cross_entropy"]


@pytest.mark.parametrize("recipe, grad_weight_in_float8", [("rowwise_with_gw_hp", False), ("rowwise_with_gw_tensorwise", True)])
def test_the_timed_block_has_the_runs_float8_linears(recipe, grad_weight_in_float8):
    """kernels=auto times a block as the run will train it: with precision=fp8 its four linears are
    the run's float8 ones (the casts are part of what a candidate costs); in bf16 they stay nn.Linear."""
    import torch

    from perflab_kernels.triton.fp8_linear import Float8RowwiseLinear
    from src.fusion.measure import build_block

    fp8 = _seed_cfg(precision="fp8", **{"precision.fp8_impl": "triton", "precision.fp8_recipe": recipe, "model": "tiny"})
    block = build_block(fp8.model, fp8.precision, torch.bfloat16, torch.device("cpu"))
    linears = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
    assert len(linears) == 4 and all(type(m) is Float8RowwiseLinear for m in linears)
    assert all(m.float8_grad_weight is grad_weight_in_float8 for m in linears)
    assert all(p.dtype == torch.bfloat16 for p in block.parameters())
    bf16 = _seed_cfg(model="tiny")
    assert all(type(m) is torch.nn.Linear for m in build_block(bf16.model, bf16.precision, torch.bfloat16, torch.device("cpu")).modules()
               if isinstance(m, torch.nn.Linear))


def test_auto_times_adamw_against_the_triton_optimizer_where_the_step_only_reports_the_norm():
    """The diagnosis calls AdamW's kernels latency-limited: with optim.impl left to auto and no
    clipping, the optimizer is timed over this rank's parameter shards (half of each dim 0 on two
    ranks, padded) and optim.impl=triton is chosen where it is faster beyond the noise; with
    clipping it is not timed at all, and the module swaps never include it."""
    from src.fusion.measure import chosen, measure, optimizer_chosen, shard_numels

    cfg = _seed_cfg(**{"optim.grad_clip": 0})
    one = shard_numels(cfg)
    assert 700e6 < sum(one) < 770e6 and len(one) == 98  # mini_llm: 735M parameters in 98 tensors
    two = shard_numels(_seed_cfg(**{"optim.grad_clip": 0, "dist.nproc": 2}))
    assert len(two) == 98 and sum(one) / 2 <= sum(two) < sum(one) / 2 * 1.001  # each rank's half, dim 0 padded to even
    table = {("adamw", "eager"): 7.2, ("adamw", "triton"): 5.4, ("rms_norm", "eager"): 0.1, ("add_rms_norm", "eager"): 0.15,
             ("block", "picked"): 5.0}
    timer, calls = _stub_timer(table)
    timings = measure(["rms_norm", "adamw"], cfg, timer)
    (adamw,) = [t for t in timings if t.op == "adamw"]
    assert adamw.ms == {"eager": pytest.approx(7.2), "triton": pytest.approx(5.4)} and adamw.pick == "triton"
    assert ("adamw", tuple(one), 1, "triton") in calls
    assert optimizer_chosen(timings) == "triton" and "adamw" not in chosen(timings)[0]
    clipped = _seed_cfg(**{"optim.grad_clip": 1.0})
    timer, calls = _stub_timer(table)
    assert optimizer_chosen(measure(["adamw"], clipped, timer)) is None and not calls
    pinned = _seed_cfg(**{"optim.grad_clip": 0, "optim.impl": "fused"})
    assert optimizer_chosen(measure(["adamw"], pinned, timer)) is None and not calls
