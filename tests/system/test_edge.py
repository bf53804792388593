"""Edge inference on this machine's real parts: IREE to Vulkan on Mesa's lavapipe (the CPU's
Vulkan driver), Metal compiled to MSL, torch on the CPU; MLflow on SQLite."""
from __future__ import annotations

import copy
import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("iree.turbine")

from src.edge.bench import generate, reference_logits, relative_errors  # noqa: E402
from src.edge.compile import FUNCTIONS, GROWING_HOISTS, NO_GROWING_HOISTS, build, load_artifacts  # noqa: E402
from src.edge.runtime import LAVAPIPE_TRIES, IreeRunner, Readback, lavapipe_retry  # noqa: E402
from src.edge.task import reference_model  # noqa: E402
from tests.support.cli import REPO, run_cli  # noqa: E402
from tests.support.lavapipe import in_own_process, needs_vulkan  # noqa: E402

TINY = {"name": "tiny", "vocab_size": 256, "dim": 64, "n_layers": 2, "n_heads": 4, "ffn_mult": 4, "causal": True,
        "norm_eps": 1e-6, "init_std": 0.02, "mlp": "silu", "ffn_hidden": 0}
# fp32: lavapipe's SPIR-V against torch's CPU kernels, summed in another order. fp16: every
# activation rounded to 11 bits through 2 blocks; measured 1.1e-3 on lavapipe.
TOLERANCE = {"fp32": 1e-4, "fp16": 1e-2}
PROMPT, STEPS, BATCH = 8, 10, 2


@pytest.fixture(scope="module")
def cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("edge_cache")


def _cli(args: list[str], cwd: Path, cache: Path):
    return run_cli(["+exp=edge", f"edge.cache_dir={cache}", f"edge.prompt_len={PROMPT}", f"edge.decode_steps={STEPS}", "edge.repeats=2", "edge.warmup=1", *args], cwd=cwd)


def _generates_torch_tokens(runner, ref, dtype: str):
    """Prefill and STEPS greedy decode steps of BATCH random prompts through `runner`, checked
    against `ref` (torch fp32): every step's logits within the dtype's tolerance, and the token
    chosen on the device torch's argmax at every step and for every sequence. Returns
    (prompt tokens, the checked generation)."""
    tokens = np.random.default_rng(1).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    gen = generate(runner, tokens, STEPS, check=True)
    want = reference_logits(ref, tokens, gen.tokens[:-1])
    errors = relative_errors(gen.logits, want)
    assert len(errors) == 1 + STEPS and max(errors) < TOLERANCE[dtype], errors
    assert [t.tolist() for t in gen.tokens] == [w.argmax(-1).tolist() for w in want]
    return tokens, gen


@needs_vulkan
@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_vulkan_prefill_and_ten_decode_steps_match_torch(dtype, tmp_path, cache):
    # in a process of its own, as the campaign runs each module: a second IREE context in one
    # process can lose lavapipe's device (src/edge/runtime.py, IreeRunner)
    in_own_process(_vulkan_matches_torch, dtype, tmp_path, cache)


def _vulkan_matches_torch(dtype: str, tmp_path: Path, cache: Path) -> None:
    import iree.runtime as rt
    import torch

    ref = reference_model(TINY, {"seed": 0}, PROMPT + STEPS, BATCH)
    lm = copy.deepcopy(ref).to({"fp32": torch.float32, "fp16": torch.float16}[dtype])
    artifacts = build(lm, TINY, PROMPT, dtype, "vulkan", "llvmpipe", "", tmp_path / "art", cache)
    runner = IreeRunner(artifacts, "vulkan")
    _generates_torch_tokens(runner, ref, dtype)
    # the cache stayed in the module and holds, after prefill + 10 in-place writes, what torch's holds
    k, v = runner.kv_cache()
    assert k.shape == tuple(ref.k_cache.shape) and np.abs(k - ref.k_cache.numpy()).max() < 5 * TOLERANCE[dtype]
    assert np.abs(v - ref.v_cache.numpy()).max() < 5 * TOLERANCE[dtype]
    # the staging readback (what NVIDIA's driver takes: it imports no host memory here) reads the same
    # cache; it raised `std::bad_cast` before, on every NVIDIA Vulkan job of the H200 campaign
    staged = Readback(rt, runner.device, ("staging",))
    assert all(np.array_equal(staged.read(a), b) for a, b in zip(runner._kv(np.zeros(1, dtype=np.int32)), (k, v))) and staged.mode == "staging"
    # and no cache crosses the call boundary: decode takes (token, pos), returns (token, logits)
    assert "decode(0rr_rr)" in repr(runner.module.lookup_function("decode"))
    assert artifacts.manifest["module_bytes"] < 400_000 and artifacts.manifest["cooperative_matrix"] is False
    assert artifacts.manifest["variant"] == "llvmpipe-nocoop"


def _llama_matches_torch(tmp_path: Path, cache: Path) -> None:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    model = OmegaConf.to_container(compose_config(["model=llama3_tiny"]).model, resolve=True)
    ref = reference_model(model, {"seed": 0}, PROMPT + STEPS, BATCH)
    artifacts = build(copy.deepcopy(ref), model, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "art", cache)
    _generates_torch_tokens(IreeRunner(artifacts, "vulkan"), ref, "fp32")
    assert tuple(ref.k_cache.shape) == (2, BATCH, 2, PROMPT + STEPS, 16)  # two key/value heads of four query heads


@needs_vulkan
def test_the_llama_family_with_rope_and_grouped_kv_cache_matches_torch_on_vulkan(tmp_path, cache):
    """model=llama3_tiny (RoPE with 3.1's scaling, 2 key/value heads for 4 query heads, a tied head,
    the norm before it) through IREE on lavapipe: prefill and ten decode steps, each step's logits
    within fp32's tolerance of torch's and the same greedy tokens."""
    in_own_process(_llama_matches_torch, tmp_path, cache)


def _large_residual_matches_torch_in_fp16(tmp_path: Path, cache: Path) -> None:
    from omegaconf import OmegaConf

    from src.config.compose import compose_config

    model = OmegaConf.to_container(compose_config(["model=llama3_tiny"]).model, resolve=True)
    ref = reference_model(model, {"seed": 0}, PROMPT + STEPS, BATCH)
    with torch.no_grad():  # the first block's MLP writes rows ~40 per entry: sums of squares past fp16's largest value
        ref.model.layers[0].ffn.down.weight.mul_(20_000)
    artifacts = build(copy.deepcopy(ref).half(), model, PROMPT, "fp16", "vulkan", "llvmpipe", "", tmp_path / "art", cache)
    _generates_torch_tokens(IreeRunner(artifacts, "vulkan"), ref, "fp16")


@needs_vulkan
def test_a_residual_stream_past_fp16s_range_normalises_as_in_fp32(tmp_path, cache):
    """A trained model's residual rows square and sum past 65504: an fp16 RMSNorm overflows to inf
    and zeroes every logit after it (relative error 1). The module's norms compute in fp32."""
    in_own_process(_large_residual_matches_torch_in_fp16, tmp_path, cache)


@needs_vulkan
def test_no_growing_hoists_by_default_take_the_constant_copy_and_its_gpu_wait_out_of_decode(tmp_path, cache):
    in_own_process(_no_growing_hoists_match_torch, tmp_path, cache)


def _no_growing_hoists_match_torch(tmp_path: Path, cache: Path) -> None:
    ref = reference_model(TINY, {"seed": 0}, PROMPT + STEPS, BATCH)
    growing = build(copy.deepcopy(ref), TINY, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "growing", cache, extra_flags=(GROWING_HOISTS,), params=False)
    flagged = build(copy.deepcopy(ref), TINY, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "flagged", cache)
    # with IREE's default hoisting, decode copies the hoisted scatter indices of its KV-cache write
    # into a fresh buffer and its other allocations wait on that copy; without growing hoists (the
    # Vulkan default here), two allocations that wait only on the previous call, the one command
    # buffer, and one dealloca
    assert growing.manifest["decode_queue_ops"] == {"alloca": 3, "barrier": 1, "copy": 1, "dealloca": 2, "execute.indirect": 1}, growing.manifest
    assert flagged.manifest["decode_queue_ops"] == {"alloca": 2, "dealloca": 1, "execute.indirect": 1}, flagged.manifest
    assert NO_GROWING_HOISTS in flagged.manifest["flags"] and NO_GROWING_HOISTS not in growing.manifest["flags"]
    assert flagged.manifest["hoisting"] == "no growing hoists" and growing.manifest["hoisting"] == "IREE's default"
    assert growing.manifest["variant"] == "llvmpipe-nocoop-growhoist" and flagged.manifest["variant"] == "llvmpipe-nocoop"
    # and the host polls: decode$async with its fence on the runner's semaphore, reads spun on too
    runner = IreeRunner(flagged, "vulkan", host_wait="poll")
    assert runner.poll and runner.readback.poll
    tokens, gen = _generates_torch_tokens(runner, ref, "fp32")
    k, v = runner.kv_cache()  # the position computed in the call lands where the hoisted indices put it
    assert np.abs(k - ref.k_cache.numpy()).max() < 5 * TOLERANCE["fp32"] and np.abs(v - ref.v_cache.numpy()).max() < 5 * TOLERANCE["fp32"]
    # the timed loop's step, polled through decode_token_into$async into the runner's mapped
    # buffers (edge.token_out=caller, the default): the same tokens
    assert runner.token_buffers is not None
    timed = generate(runner, tokens, STEPS)
    assert [t.tolist() for t in timed.tokens] == [t.tolist() for t in gen.tokens]


@needs_vulkan
def test_decode_token_gives_decode_tokens_and_cache_without_the_logits_result(tmp_path, cache):
    # a process (one context) per function: on lavapipe the second kv_cache call of a context can
    # return other data than the cache (measured: every other call, with or without decode_token)
    # decode_token_into: the token written into the runner's own mapped buffers (edge.token_out=caller)
    got = {}
    for function in ("decode_token_into", "decode_token", "decode"):
        got[function] = in_own_process(_generate_and_read_cache, function, tmp_path / function, cache)
    want_tokens, want_k, want_v = got["decode"]
    for function in ("decode_token_into", "decode_token"):
        tokens, k, v = got[function]
        assert tokens == want_tokens and np.array_equal(k, want_k) and np.array_equal(v, want_v), function


def _generate_and_read_cache(function: str, tmp_path: Path, cache: Path) -> tuple[list, np.ndarray, np.ndarray]:
    """Greedy generation through `function` on a fresh context: its tokens (torch's argmax at every
    step) and the cache it leaves (torch's)."""
    ref = reference_model(TINY, {"seed": 0}, PROMPT + STEPS, BATCH)
    art = build(copy.deepcopy(ref), TINY, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "art", cache)
    m = art.manifest
    assert m["functions"] == list(FUNCTIONS) and m["decode_token_queue_ops"] == m["decode_queue_ops"], m
    # the same queue ops; the results' allocation shrinks from the tokens and the (2, 256) fp32
    # logits (64-byte aligned) to the tokens, and the logits fit in the transients decode already had
    assert m["decode_alloca_bytes"] == [2112, 26240] and m["decode_token_alloca_bytes"] == [8, 26240], m
    # into the caller's buffer: no result allocation at all, the transients alone
    assert m["decode_token_into_alloca_bytes"] == [26240] and m["decode_token_into_queue_ops"] == {**m["decode_queue_ops"], "alloca": 1}, m
    # the time to first token's call likewise: the prefill's transients alone, no results
    assert m["prefill_token_into_alloca_bytes"] == m["prefill_alloca_bytes"][1:], m
    assert m["prefill_token_into_queue_ops"] == {**m["prefill_queue_ops"], "alloca": m["prefill_queue_ops"]["alloca"] - 1}, m
    runner = IreeRunner(art, "vulkan", token_out="caller" if function == "decode_token_into" else "result")
    # the prompt through the runner's mapped buffer where the token goes into its own
    assert (runner.prompt is not None) == (function == "decode_token_into")
    assert runner.has_decode_token and "decode_token(0rr_r)" in repr(runner.module.lookup_function("decode_token"))
    assert (runner.token_buffers is not None) == (function == "decode_token_into")
    tokens = np.random.default_rng(1).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
    gen = generate(runner, tokens, STEPS, check=function == "decode")  # generate's timed steps are decode_token's
    k, v = runner.kv_cache()  # on the zeroed cache: every position read was written by this generation
    want = reference_logits(ref, tokens, gen.tokens[:-1])
    assert [t.tolist() for t in gen.tokens] == [w.argmax(-1).tolist() for w in want]
    assert np.abs(k - ref.k_cache.numpy()).max() < 5 * TOLERANCE["fp32"] and np.abs(v - ref.v_cache.numpy()).max() < 5 * TOLERANCE["fp32"]
    if function == "decode_token_into":  # (after the cache read: this step writes the cache again)
        buffers = runner.token_buffers
        # a step writes the buffer its input is not in, and its token is read there, no copy
        reads = runner.readback._reads
        out = runner.decode_token(buffers.arrays[1], PROMPT + STEPS - 1)
        assert out is buffers.arrays[0] and np.array_equal(runner.tokens(out), buffers.host[0])
        assert runner.readback._reads == reads  # no copy was queued to read it
    return [t.tolist() for t in gen.tokens], k, v


@needs_vulkan
def test_a_module_compiled_before_decode_token_runs_through_decode(tmp_path, cache):
    in_own_process(_old_module_falls_back, tmp_path, cache)


def _old_module_falls_back(tmp_path: Path, cache: Path) -> None:
    import logging

    ref = reference_model(TINY, {"seed": 0}, PROMPT + STEPS, BATCH)
    old = build(copy.deepcopy(ref), TINY, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "old", cache, {"seed": 0},
                functions=("prefill", "decode", "kv_cache"))
    assert old.manifest["functions"] == ["prefill", "decode", "kv_cache"] and old.manifest["decode_token_queue_ops"] is None
    said: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: said.append(record.getMessage())
    logging.getLogger("src.edge").addHandler(handler)
    for host_wait in ("block", "poll"):
        runner = IreeRunner(old, "vulkan", host_wait=host_wait)
        tokens = np.random.default_rng(1).integers(0, 256, (BATCH, PROMPT)).astype(np.int32)
        timed = [generate(runner, tokens, STEPS) for _ in range(2)]
        want = reference_logits(ref, tokens, timed[0].tokens[:-1])
        assert all([t.tolist() for t in g.tokens] == [w.argmax(-1).tolist() for w in want] for g in timed)
    # said once per runner, not once per step
    assert [s for s in said if "decode_token" in s] == [f"{old.vmfb} has no decode_token (compiled before it): timed steps call decode and drop its logits"] * 2, said
    # the round-trip probe says so in its row instead of failing
    proc = run_cli(["--module", str(old.dir), "--function", "decode_token", "--json", str(tmp_path / "probe.json")], cwd=tmp_path, module="benchmarks.edge_roundtrip")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (row,) = json.loads((tmp_path / "probe.json").read_text())
    assert row["function"] == "decode_token" and row["tokens_agree"] == "not in this module (compiled before decode_token)", row



def test_the_greedy_token_is_torch_argmax_with_ties_to_the_first_index():
    from src.edge.model import greedy_token

    torch.manual_seed(0)
    logits = torch.randn(6, 4099)
    logits[1, 7] = logits[1, 4000] = 50.0  # a tie: the first index wins, as torch.argmax's
    logits[2, -1] = 60.0
    for dtype in (torch.float32, torch.float16):
        got = greedy_token(logits.to(dtype))
        assert got.dtype == torch.int32 and torch.equal(got.long(), logits.to(dtype).argmax(-1))
    logits[3] = float("nan")  # nothing equals a NaN maximum: still a token of the vocabulary
    assert 0 <= int(greedy_token(logits)[3]) < 4099



@pytest.fixture(scope="module")
def compile_run(tmp_path_factory, cache) -> Path:
    """One `edge.action=compile` run, untracked, for the tests that run, edit or break its artifacts
    (each its own copy, `_compiled`): the folder it ran in, its artifacts in `art` there."""
    cwd = tmp_path_factory.mktemp("compiled")
    proc = _cli(["edge.action=compile", f"edge.artifacts={cwd / 'art'}", "tracking=none"], cwd, cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # the export and the compile say nothing of their own: no torch.export FutureWarning per program,
    # no iree-compile command line (issue 74)
    assert "Warning" not in proc.stderr and "Invoke IREE Tool" not in proc.stdout + proc.stderr, proc.stdout + proc.stderr
    return cwd


def _compiled(tmp_path: Path, compile_run: Path) -> Path:
    art = tmp_path / "art"
    shutil.copytree(compile_run / "art", art)
    return art


@needs_vulkan
def test_compile_then_run_from_the_artifact_directory_gives_the_same_numbers(tmp_path, cache, compile_run):
    art = _compiled(tmp_path, compile_run)
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["target"] == "llvmpipe" and manifest["weights"] == {"seed": 0} and (art / "params.irpa").is_file()

    proc = _cli(["edge.action=run", f"edge.artifacts={art}", "tracking=none"], tmp_path, cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _cli(["tracking=none"], tmp_path, cache)  # bench: compiles (from the cache) and runs in one go
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert f"source, compiled from {REPO} at " in proc.stdout  # a cached module says whose compile it is
    summaries = sorted((json.loads(p.read_text()) for folder in (compile_run, tmp_path) for p in folder.glob("outputs/*/*/summary.json")),
                       key=lambda s: s["action"])
    benched, compiled, ran = summaries
    assert [s["action"] for s in summaries] == ["bench", "compile", "run"] and benched["cache"] == "hit"
    assert compiled["cache"] == "miss" and compiled["status"] == "finished" and compiled["module_bytes"] > 0 and compiled["variant"] == "llvmpipe-nocoop"
    assert ran["generated"] == benched["generated"] and len(ran["generated"][0]) == STEPS + 1 and ran["greedy_mismatches"] == 0
    assert ran["rel_err_per_step"] == benched["rel_err_per_step"] and ran["rel_err"] < TOLERANCE["fp32"]
    for key in ("first_run_ms", "ttft_p50_ms", "ttft_p90_ms", "decode_p50_ms", "decode_p90_ms", "prefill_tokens_per_s", "decode_tokens_per_s", "h2d_copy_ms", "d2h_readback_ms"):
        assert ran[key] > 0, key
    assert "llvmpipe" in ran["device_name"] and ran["cooperative_matrix"] in (False, None) and ran["readback"] in ("imported", "staging", "mapped")
    assert ran["h2d_import_ms"] is None or ran["h2d_import_ms"] > 0  # lavapipe imports page-aligned host memory
    assert 1 <= ran["device_tries"] <= LAVAPIPE_TRIES  # more than 1 only where lavapipe lost the device mid-run


def _edit_manifest(art: Path, **changes) -> None:
    manifest = json.loads((art / "manifest.json").read_text())
    (art / "manifest.json").write_text(json.dumps({**manifest, **changes}))


@needs_vulkan
def test_wrong_numbers_end_the_run_failed_in_one_line(tmp_path, cache, compile_run):
    art = _compiled(tmp_path, compile_run)
    _edit_manifest(art, weights={"seed": 1})  # the reference from other weights than the archive holds
    proc = _cli(["edge.action=run", f"edge.artifacts={art}"], tmp_path, cache)
    last = proc.stderr.strip().splitlines()[-1]  # above it only MLflow's own lines about creating its tables
    assert proc.returncode == 1 and proc.stderr.count("error:") == 1, proc.stderr
    assert last.startswith("error: vulkan llvmpipe fp32: max relative error ") and "exceeds the fp32 tolerance 0.001" in last
    assert "Traceback" not in proc.stdout + proc.stderr
    (run_dir,) = [p.parent for p in tmp_path.glob("outputs/*/*/summary.json") if "action=run" in (p.parent / ".hydra" / "overrides.yaml").read_text()]
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "failed"
    measured = json.loads((run_dir / "edge_summary.json").read_text())
    assert measured["status"] == "failed" and measured["rel_err"] > 0.001 and "| failed |" in (run_dir / "run.log").read_text()
    from mlflow.tracking import MlflowClient  # here, not at the top: the spawned processes import this module

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FAILED" and "exceeds the fp32 tolerance" in run.data.tags["error"] and run.data.metrics["summary.rel_err"] > 0.001


@needs_vulkan
@pytest.mark.parametrize("change,line", [
    # issue 13: adreno-compiled SPIR-V ran on lavapipe with relative error 1.09 and `finished`
    ({"target": "adreno"}, "error: edge.target=adreno artifacts are for qualcomm GPUs and this Vulkan device is llvmpipe"),
    ({"cooperative_matrix": True, "variant": "ampere-coop", "dtype": "fp16"},
     "error: target llvmpipe fp16 module (ampere-coop) failed on llvmpipe"),
])
def test_a_module_that_cannot_run_here_is_one_line(change, line, tmp_path, cache, compile_run):
    art = _compiled(tmp_path, compile_run)
    _edit_manifest(art, **change)
    if "cooperative_matrix" in change:
        (art / "module.vmfb").write_bytes(b"not a module")  # what the driver cannot load, as NVIDIA's could not the fp16 one
    proc = _cli(["edge.action=run", f"edge.artifacts={art}", "tracking=none"], tmp_path, cache)
    assert proc.returncode == 1 and proc.stderr.startswith(line) and proc.stderr.count("\n") == 1, proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    if "cooperative_matrix" in change:
        assert "try the variant without cooperative matrices: edge.target=pascal" in proc.stderr
        # the module never loaded: one runner tried (a lost device is the only error tried again)
        (measured,) = [json.loads(p.read_text()) for p in tmp_path.glob("outputs/*/*/edge_summary.json")]
        assert measured["status"] == "failed" and measured["device_tries"] == 1


@needs_vulkan
def test_a_decode_longer_than_the_modules_cache_is_refused_before_it_starts(tmp_path, cache, compile_run):
    """The module caches prompt + its compile's decode steps; more decode steps would index past it."""
    art = _compiled(tmp_path, compile_run)
    proc = _cli(["edge.action=run", f"edge.artifacts={art}", f"edge.decode_steps={STEPS + 5}"], tmp_path, cache)
    assert proc.returncode == 2 and proc.stderr.startswith(f"error: edge.decode_steps={STEPS + 5}: the module at {art} caches "
                                                           f"{PROMPT + STEPS} positions, its prompt {PROMPT}; use edge.decode_steps<={STEPS}"), proc.stderr
    assert proc.stderr.count("\n") == 1 and not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


@needs_vulkan
def test_a_two_job_sweep_is_one_parent_with_two_children(tmp_path, cache, compile_run):
    # the module's shapes and settings are _cli's: the vulkan job takes compile_run's module from the cache
    proc = run_cli(["-m", "+exp=edge", "backend=vulkan,cpu", f"edge.cache_dir={cache}", f"edge.prompt_len={PROMPT}", f"edge.decode_steps={STEPS}",
                    "edge.repeats=2", "edge.warmup=1"], cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    from mlflow.tracking import MlflowClient  # here, not at the top: the spawned processes import this module

    client = MlflowClient(f"sqlite:///{tmp_path / 'mlflow.db'}")
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    (parent,) = [r for r in runs if "mlflow.parentRunId" not in r.data.tags]
    children = [r for r in runs if r.data.tags.get("mlflow.parentRunId") == parent.info.run_id]
    assert sorted(r.data.params["backend.name"] for r in children) == ["cpu", "vulkan"]
    assert all(r.info.status == "FINISHED" and r.data.metrics["summary.decode_tokens_per_s"] > 0 for r in children)
    assert {"sweep.csv", "sweep.png", "latency.png"} <= {a.path for a in client.list_artifacts(parent.info.run_id)}
    (sweep_dir,) = list(tmp_path.glob("multirun/*/*"))
    assert (sweep_dir / "latency.png").stat().st_size > 5_000


def test_metal_compile_writes_msl(tmp_path, cache):
    proc = _cli(["backend=mps", "edge.action=compile", f"edge.artifacts={tmp_path / 'metal'}", "tracking=none"], tmp_path, cache)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sources = list((tmp_path / "metal" / "msl").glob("*.metal"))
    assert sources and "kernel void" in sources[0].read_text() and "#include <metal_stdlib>" in sources[0].read_text()
    manifest = json.loads((tmp_path / "metal" / "manifest.json").read_text())
    assert manifest["device"] == "metal" and manifest["target"] == "macos" and len(manifest["msl_files"]) == len(sources)


@pytest.mark.parametrize("args,env,line", [
    (["backend=mps"], {}, "error: backend=mps needs Apple Silicon (torch.backends.mps.is_available() is False here)"),
    (["edge.target=mali"], {}, "error: edge.target=mali: not a Vulkan target IREE knows; use one of llvmpipe"),
    (["edge.dtype=bf16"], {}, "error: edge.dtype=bf16: Vulkan target llvmpipe computes in fp32 or fp16"),
    ([], {"VK_DRIVER_FILES": "/nonexistent.json", "VK_ICD_FILENAMES": "/nonexistent.json"}, "error: backend=vulkan: no Vulkan driver found; install one: `apt-get install mesa-vulkan-drivers`"),
    (["edge.action=run", "edge.artifacts=nowhere"], {}, "error: edge.artifacts=nowhere: no manifest.json there"),
])
def test_bad_input_is_one_line_and_starts_nothing(args, env, line, tmp_path, monkeypatch):
    if "backend=mps" in args and __import__("torch").backends.mps.is_available():
        pytest.skip("this machine has MPS")
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    proc = run_cli(["+exp=edge", *args], cwd=tmp_path)
    assert proc.returncode == 2 and proc.stderr.startswith(line), proc.stderr
    assert not (tmp_path / "outputs").exists() and not (tmp_path / "mlflow.db").exists()


def test_load_artifacts_names_what_is_missing(tmp_path):
    with pytest.raises(FileNotFoundError, match="no manifest.json; make the artifacts with edge.action=compile"):
        load_artifacts(tmp_path)




def test_work_that_lost_the_device_runs_again_on_a_new_device_on_lavapipe_only():
    """src/edge/runtime.py lavapipe_retry, its policy: work that raised lavapipe's lost device runs
    again on a runner asked for a device of its own; off lavapipe, or with any other error, or a
    context that could not be made at all (ModuleLoadFailed), the first error stands; the tries
    stop at LAVAPIPE_TRIES."""
    from src.edge.runtime import ModuleLoadFailed

    lost = "Copying buffer on queue: queue.c:6000: DATA_LOSS; [vkWaitSemaphores] VK_ERROR_DEVICE_LOST"

    def retried(failures: int, error: type = RuntimeError, text: str = lost, lavapipe: bool = True) -> tuple[object, list[bool]]:
        """lavapipe_retry on work that raises `error(text)` on its first `failures` tries: its
        result (or the error it raised) and each try's fresh_device."""
        fresh: list[bool] = []

        def work(runner: bool) -> str:
            if len(fresh) <= failures:
                raise error(text)
            return "tokens"
        try:
            return lavapipe_retry(lambda f: fresh.append(f) or f, work, lavapipe), fresh
        except RuntimeError as err:
            return err, fresh

    assert retried(2) == ("tokens", [False, True, True])
    # the first error stands: off lavapipe, another error, a context never made; and the last try's
    for (got, tries), want in ((retried(1, lavapipe=False), 1), (retried(1, text="RESOURCE_EXHAUSTED; VK_ERROR_OUT_OF_DEVICE_MEMORY"), 1),
                               (retried(1, error=ModuleLoadFailed), 1), (retried(LAVAPIPE_TRIES), LAVAPIPE_TRIES)):
        assert isinstance(got, RuntimeError) and len(tries) == want, (got, tries)


def test_the_retries_follow_the_default_device_not_any_lavapipe_beside_it(monkeypatch):
    """on_lavapipe reads IREE's default Vulkan device, the first it lists: a machine with a GPU
    listed first and lavapipe after it runs on the GPU, whose errors are never retried. The lists
    are the names IREE gives (no second Vulkan device on a CI machine to list for real)."""
    from src.edge import runtime

    gpu, cpu = "NVIDIA H100 80GB HBM3", "llvmpipe (LLVM 15.0.6, 256 bits)"
    for names, want in (([gpu, cpu], False), ([cpu, gpu], True), ([cpu], True), ([gpu], False), ([], False)):
        monkeypatch.setattr(runtime, "vulkan_device_names", lambda names=names: names)
        assert runtime.on_lavapipe() is want, names


@needs_vulkan
def test_a_run_that_lost_the_device_goes_on_on_a_device_of_its_own_with_torch_tokens(tmp_path, cache):
    in_own_process(_retried_run_matches_torch, tmp_path, cache)


def _retried_run_matches_torch(tmp_path: Path, cache: Path) -> None:
    """task=infer's path through lavapipe_retry: the first try's runner on the process's shared
    device, its work ended by the error lavapipe gives; the second's on a device of its own, a new
    context, and its generation torch's."""
    ref = reference_model(TINY, {"seed": 0}, PROMPT + STEPS, BATCH)
    art = build(copy.deepcopy(ref), TINY, PROMPT, "fp32", "vulkan", "llvmpipe", "", tmp_path / "art", cache)
    runners = []

    def make(fresh: bool) -> IreeRunner:
        runners.append(IreeRunner(art, "vulkan", fresh_device=fresh))
        return runners[-1]

    def work(runner: IreeRunner):
        if len(runners) == 1:
            raise RuntimeError("Copying buffer on queue: queue.c:6000: DATA_LOSS; [vkWaitSemaphores] VK_ERROR_DEVICE_LOST")
        return _generates_torch_tokens(runner, ref, "fp32")

    _, gen = lavapipe_retry(make, work, lavapipe=True)
    assert len(runners) == 2 and runners[1].device is not runners[0].device and len(gen.tokens) == STEPS + 1


def test_an_iree_tool_that_lost_the_device_runs_again_on_lavapipe_only(tmp_path):
    """src/edge/runtime.py run_tool: a tool run (here a stand-in process) that fails twice with
    lavapipe's lost device and then succeeds is run three times on lavapipe; off lavapipe, or with
    an error that is not a lost device, its first result stands; and the tries stop at
    LAVAPIPE_TRIES. One that died of a signal is run again on lavapipe too."""
    import signal
    import sys

    from src.edge.runtime import LAVAPIPE_TRIES, run_tool

    def tool(failures: int, error: str) -> tuple[list[str], Path]:
        count = tmp_path / f"runs-{len(list(tmp_path.iterdir()))}"
        count.write_text("0")
        fail = "os.kill(os.getpid(), signal.SIGSEGV)" if error == "SIGSEGV" else f"sys.exit('queue.c:2867: {error}')"
        script = (f"import os, pathlib, signal, sys; p = pathlib.Path({str(count)!r}); n = int(p.read_text()) + 1; p.write_text(str(n)); "
                  f"{fail} if n <= {failures} else sys.exit(0)")
        return [sys.executable, "-c", script], count

    cmd, runs = tool(2, "DATA_LOSS; [vkSignalSemaphore] VK_ERROR_DEVICE_LOST")
    assert run_tool(cmd, lavapipe=True, timeout=60).returncode == 0 and runs.read_text() == "3"
    cmd, runs = tool(2, "DATA_LOSS; [vkSignalSemaphore] VK_ERROR_DEVICE_LOST")
    assert run_tool(cmd, lavapipe=False, timeout=60).returncode == 1 and runs.read_text() == "1"
    cmd, runs = tool(2, "RESOURCE_EXHAUSTED; [vkAllocateMemory] VK_ERROR_OUT_OF_DEVICE_MEMORY")
    proc = run_tool(cmd, lavapipe=True, timeout=60)
    assert proc.returncode == 1 and runs.read_text() == "1" and "OUT_OF_DEVICE_MEMORY" in proc.stderr
    cmd, runs = tool(LAVAPIPE_TRIES, "DATA_LOSS; [vkSignalSemaphore] VK_ERROR_DEVICE_LOST")
    assert run_tool(cmd, lavapipe=True, timeout=60).returncode == 1 and runs.read_text() == str(LAVAPIPE_TRIES)
    # a tool that died of a signal (no output: its stdout buffer went with it) is run again on lavapipe
    cmd, runs = tool(1, "SIGSEGV")
    assert run_tool(cmd, lavapipe=True, timeout=60).returncode == 0 and runs.read_text() == "2"
    cmd, runs = tool(1, "SIGSEGV")
    assert run_tool(cmd, lavapipe=False, timeout=60).returncode == -signal.SIGSEGV and runs.read_text() == "1"
